"""A streaming client for a running server (gRPC through tritonclient, or HTTP generate_stream)."""

from __future__ import annotations

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


def _inputs(grpcclient, prompt: str, params: SamplingParams, chat: bool, stream: bool):
    return infer_inputs(
        grpcclient, MasterRequest(text=prompt, params=_params(params), stream=stream, chat=chat).encode()
    )


def _params(p: SamplingParams) -> dict:
    d = p.to_dict()
    return {k: v for k, v in d.items() if v not in (None, [])}


def generate_remote(
    url: str, prompt: str, params: SamplingParams, chat: bool = False, protocol: str = "grpc", echo: bool = True
) -> dict:
    if protocol == "http":
        return _generate_http(url, prompt, params, chat, echo)
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(
            "pd_master", _inputs(grpcclient, prompt, params, chat, True), enable_empty_final_response=True
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


def _generate_http(url, prompt, params, chat, echo) -> dict:
    import urllib.request

    body = json.dumps(
        {"text_input": prompt, "apply_chat_template": chat, "sampling_parameters": json.dumps(_params(params))}
    ).encode()
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
            ids += ev.get("output_ids", [])
            text.append(ev.get("text_output", ""))
            if echo:
                print(ev.get("text_output", ""), end="", flush=True)
            reason = ev.get("finish_reason") or reason
    return {
        "output_ids": ids,
        "text": "".join(text),
        "finish_reason": reason if isinstance(reason, str) else (reason[0] if reason else None),
    }
