"""An OpenAI-compatible front end (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) over `pd_master`.

Built on FastAPI and uvicorn; every request becomes one streamed Triton gRPC call to `pd_master` (tritonclient's
asyncio client), so pauses, recoveries, stop strings and cancellation are the deployment's own. A client that goes
away mid-stream cancels its gRPC call, which cancels the answer in pd_master and decode.

- chat: the messages go through the model's chat template here (the rendered text is sent as `text_input`, which
  pd_master tokenises as it tokenises any text), so multi-turn and system messages work;
- `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`, `seed`, `stop` (a string or a list) map to
  pd_master's sampling parameters; `n` > 1, `logprobs`, non-zero penalties and tools are refused with a clear
  error; other fields OpenAI defines (`user`, `metadata`, ...) are ignored;
- images (Qwen3.5 checkpoints): `image_url` content parts whose URL is a `data:image/png;base64,...` or
  `data:image/jpeg;base64,...` URL become pd_master's `image` input, each in its place in the message (Qwen's
  placeholder); any other URL is a 400 naming the part: the server fetches nothing;
- `usage` (prompt and completion tokens) comes from pd_master's own counts; a streamed answer carries it in a last
  chunk when `stream_options.include_usage` is set, as OpenAI does;
- errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: pd_master's INVALID_ARG is 400
  naming the parameter, its UNAVAILABLE (server busy) 503.

    triton-pd serve --openai-port 9000 ...            (started and stopped with the server)
    python -m backends.openai_frontend --grpc-url 127.0.0.1:8001 --model smollm2 --port 9000"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request, defined in
# create_app) as objects
import argparse
import json
import re
import time
import uuid
from dataclasses import dataclass, field

from .common.core.request import IMAGE_PLACEHOLDER
from .common.serving.wire import MasterRequest

MAX_BODY = 8 << 20  # bytes of a request body


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


UNSUPPORTED = {
    "logprobs": "logprobs are not supported",
    "top_logprobs": "logprobs are not supported",
    "tools": "tool calls are not supported",
    "functions": "function calls are not supported",
    "response_format": "response formats are not supported",
    "suffix": "suffix is not supported",
    "echo": "echo is not supported",
    "best_of": "best_of is not supported",
    "logit_bias": "logit_bias is not supported",
}
# penalties change the answer: refused unless 0 (the default) rather than ignored
UNSUPPORTED_UNLESS_ZERO = ("presence_penalty", "frequency_penalty")


@dataclass
class Call:
    """One OpenAI request as pd_master inputs."""

    text: str | None
    ids: list[int] | None
    params: dict
    stream: bool
    include_usage: bool
    chat: bool
    model: str
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    images: list[bytes] = field(default_factory=list)  # base64 text of each image, in the prompt's order


def sampling(body: dict) -> dict:
    """OpenAI's sampling fields as pd_master's `sampling_parameters` (vLLM names)."""
    for k in body:
        if k in UNSUPPORTED:
            raise APIError(400, UNSUPPORTED[k], k)
    for k in UNSUPPORTED_UNLESS_ZERO:
        if body.get(k) not in (None, 0, 0.0):
            raise APIError(400, f"{k} is not supported (only 0)", k)
    if body.get("n", 1) not in (1, None):
        raise APIError(400, "only n = 1 is supported", "n")
    p = {}
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None:
        p["max_tokens"] = mt
    for k in ("temperature", "top_p", "seed", "top_k", "min_tokens", "ignore_eos", "stop_token_ids"):
        if body.get(k) is not None:
            p[k] = body[k]
    stop = body.get("stop")
    if stop is not None:
        p["stop"] = [stop] if isinstance(stop, str) else stop
    return p


DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,(.*)", re.DOTALL)


def _content(msg: dict, i: int, images: list[bytes]) -> str:
    """A message's text; its image parts' base64 payloads go to `images`, each leaving a placeholder in the text."""
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text and images
        parts = []
        for j, part in enumerate(c):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "image_url":
                images.append(_data_url(part.get("image_url"), f"messages[{i}].content[{j}].image_url"))
                parts.append(IMAGE_PLACEHOLDER)
            else:
                raise APIError(400, "content parts must be text or image_url", f"messages[{i}].content[{j}]")
        return "".join(parts)
    raise APIError(400, "content must be a string or a list of content parts", f"messages[{i}].content")


def _data_url(value, param: str) -> bytes:
    """The base64 payload of a PNG or JPEG data URL; anything else (an http(s) URL included) is a 400."""
    url = value.get("url") if isinstance(value, dict) else value
    m = DATA_URL.fullmatch(url.strip()) if isinstance(url, str) else None
    if m is None:
        raise APIError(400, "only data URLs of PNG or JPEG images (data:image/png;base64,...) are taken: the "
                       "server fetches nothing", param)  # fmt: skip
    return m.group(2).encode()


def chat_call(body: dict, tokenizer, model: str) -> Call:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "messages must be a non-empty list", "messages")
    clean, images = [], []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, "each message needs a role", f"messages[{i}]")
        clean.append({"role": m["role"], "content": _content(m, i, images)})
    try:
        text = tokenizer.apply_chat_template(clean, add_generation_prompt=True)
    except Exception as e:  # TemplateError (no template: a random-weight model) or the template's own error
        raise APIError(400, f"chat template: {e}", "messages") from None
    return Call(text, None, sampling(body), bool(body.get("stream")), _usage_opt(body), True, model, images=images)


def completion_call(body: dict, model: str) -> Call:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        text, ids = None, prompt
    else:
        raise APIError(400, "prompt must be a string or a list of token ids (one prompt)", "prompt")
    return Call(text, ids, sampling(body), bool(body.get("stream")), _usage_opt(body), False, model)


def _usage_opt(body: dict) -> bool:
    so = body.get("stream_options")
    return isinstance(so, dict) and bool(so.get("include_usage"))


def _error_from_triton(msg: str) -> APIError:
    """pd_master's errors start with the field they are about ("max_tokens: must be > 0"); its busy answer is
    UNAVAILABLE."""
    low = msg.lower()
    if "unavailable" in low or "server busy" in low:
        return APIError(503, msg, None, "server_error")
    head = msg.split(":", 1)[0].strip()
    if head and " " not in head and len(head) < 64:
        return APIError(400, msg, head)
    return APIError(500, msg, None, "server_error")


class Backend:
    """pd_master over Triton gRPC (asyncio)."""

    def __init__(self, grpc_url: str):
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as aioclient

        self.url, self.grpc, self.aio = grpc_url, grpcclient, aioclient
        self._client = None

    def client(self):
        if self._client is None:  # made inside the server's event loop
            self._client = self.aio.InferenceServerClient(self.url)
        return self._client

    async def parts(self, call: Call):
        """Yields (text delta, new ids, finish_reason or None, counts or None) until the answer ends."""
        from .client import infer_inputs

        req = MasterRequest(text=call.text, ids=call.ids, params=call.params, stream=True, images=call.images or None)
        inputs = infer_inputs(self.grpc, req.encode())
        outputs = [self.grpc.InferRequestedOutput(n) for n in MasterRequest.OUTPUTS]

        async def one():
            yield {"model_name": MasterRequest.MODEL, "inputs": inputs, "outputs": outputs, "request_id": call.rid}

        it = self.client().stream_infer(one())
        done = False
        try:
            async for result, error in it:
                if error is not None:
                    raise _error_from_triton(str(error.message() if hasattr(error, "message") else error))
                text = result.as_numpy("text_output")
                ids = result.as_numpy("output_ids")
                reason = result.as_numpy("finish_reason")
                delta = b"".join(text.tolist()).decode("utf-8", "replace") if text is not None else ""
                new_ids = [] if ids is None else [int(x) for x in ids]
                fin = None if reason is None else b"".join(reason.tolist()).decode() or None
                counts = None
                if fin is not None:
                    counts = (int(result.as_numpy("num_input_tokens")[0]), int(result.as_numpy("num_output_tokens")[0]))
                yield delta, new_ids, fin, counts
                if fin is not None:
                    done = True
                    return
        finally:
            if not done:  # the client went away or an error: cancel the call, which cancels the answer
                it.cancel()

    async def ready(self) -> bool:
        try:
            return bool(await self.client().is_model_ready(MasterRequest.MODEL))
        except Exception:
            return False


def _usage(counts) -> dict:
    p, c = counts or (0, 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def create_app(backend: Backend, model: str, tokenizer):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="triton-pd OpenAI-compatible API", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    async def parse(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise APIError(413, f"request body over {MAX_BODY} bytes")
        try:
            body = json.loads(raw or b"{}")
        except ValueError as e:
            raise APIError(400, f"malformed JSON ({e})") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        name = body.get("model")
        if name is not None and name != model:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model!r}", "model",
                           "model_not_found")  # fmt: skip
        return body

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "triton-pd"}]}

    @app.get("/health")
    async def health():
        ok = await backend.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def run(call: Call, kind: str):
        created, oid = int(time.time()), ("chatcmpl-" if kind == "chat" else "cmpl-") + call.rid
        obj = "chat.completion" if kind == "chat" else "text_completion"

        def choice(delta: str, fin, first: bool = False) -> dict:
            if kind == "chat":
                d = {"role": "assistant", "content": delta} if first else {"content": delta}
                return {"index": 0, "delta": d, "logprobs": None, "finish_reason": fin}
            return {"index": 0, "text": delta, "logprobs": None, "finish_reason": fin}

        if call.stream:
            gen = backend.parts(call)
            try:  # the first part before the response starts, so that a refused request is an HTTP error
                first = await gen.__anext__()
            except StopAsyncIteration:
                first = None

            async def events():
                try:
                    part, is_first = first, True
                    while part is not None:
                        delta, _, fin, counts = part
                        chunk = {"id": oid, "object": obj + ".chunk" if kind == "chat" else obj, "created": created,
                                 "model": model, "choices": [choice(delta, _reason(fin), is_first)]}  # fmt: skip
                        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                        is_first = False
                        if fin is not None:
                            if call.include_usage:
                                last = {"id": oid, "object": chunk["object"], "created": created, "model": model,
                                        "choices": [], "usage": _usage(counts)}  # fmt: skip
                                yield f"data: {json.dumps(last)}\n\n"
                            break
                        try:
                            part = await gen.__anext__()
                        except StopAsyncIteration:
                            part = None
                    yield "data: [DONE]\n\n"
                except APIError as e:  # after the response started: an error event, as OpenAI streams do
                    yield f"data: {json.dumps(e.body())}\n\n"
                finally:
                    await gen.aclose()

            return StreamingResponse(events(), media_type="text/event-stream")
        text, fin, counts = [], None, None
        async for delta, _, f, c in backend.parts(call):
            text.append(delta)
            fin, counts = f or fin, c or counts
        out = "".join(text)
        if kind == "chat":
            ch = {"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": None,
                  "finish_reason": _reason(fin)}  # fmt: skip
        else:
            ch = {"index": 0, "text": out, "logprobs": None, "finish_reason": _reason(fin)}
        return {"id": oid, "object": obj, "created": created, "model": model, "choices": [ch], "usage": _usage(counts)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await run(chat_call(await parse(request), tokenizer, model), "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(completion_call(await parse(request), model), "completion")

    return app


def _reason(fin: str | None) -> str | None:
    """pd_master's finish reasons are OpenAI's (stop, length); a cancelled answer reads as stop."""
    if fin is None:
        return None
    return fin if fin in ("stop", "length") else "stop"


def load_tokenizer(model: str):
    from .common.model import loader

    return loader.load_tokenizer(loader.resolve(model))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc-url", required=True, help="pd_master's server, HOST:PORT (gRPC)")
    ap.add_argument("--model", required=True, help="the served model (its tokenizer's chat template; its name)")
    ap.add_argument("--served-name", default=None, help="the name clients use (default: --model)")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=9000)
    a = ap.parse_args(argv)
    import uvicorn

    from .common.model.loader import ModelError

    try:
        tok = load_tokenizer(a.model)
    except ModelError as e:
        print(f"openai frontend: error: {e}")
        return 2
    app = create_app(Backend(a.grpc_url), a.served_name or a.model, tok)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
