"""Property-based fuzzing of pd_master over gRPC and HTTP (hypothesis, seeded, a bounded number of examples): random
and malformed sampling parameters, wrong tensor types and shapes, empty and huge prompts, out-of-vocabulary and
negative ids, unicode stop strings, extreme values. Every request gets an error naming the field it is about or a
correct answer; the server keeps serving and decode's and master's counts return to 0. The internal models, fuzzed
the same way without the deployment's key, refuse every request naming internal_key."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.client import infer_inputs
from backends.common.core.request import SamplingParams
from backends.common.serving.wire import DecodeRequest, PrefillRequest
from tests.server.client import StreamClient, grpc_generate, http_post

pytestmark = [pytest.mark.server]

VOCAB = 320  # random:tiny-test: byte-level ids 0..255 decode to text, the rest to nothing
PARAMS = [f.name for f in fields(SamplingParams)]
INPUTS = ["text_input", "input_ids", "stream", "sampling_parameters", "exclude_input_in_output",
          "apply_chat_template", "image"]  # fmt: skip
FIELDS = set(PARAMS) | set(INPUTS) | {"parameters"}
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip

ints = st.one_of(st.integers(-3, 40), st.sampled_from([0, -1, 2**31, 2**63 - 1, -(2**63), 10**30]))
floats = st.one_of(st.floats(-2, 3), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, 0.0]))
junk = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=8), st.lists(ints, max_size=3), st.just({}))
values = {
    "max_tokens": st.one_of(st.integers(-2, 24), junk),
    "temperature": st.one_of(floats, junk),
    "top_p": st.one_of(floats, junk),
    "top_k": st.one_of(ints, junk),
    "seed": st.one_of(ints, junk),
    "min_tokens": st.one_of(st.integers(-2, 8), junk),
    "ignore_eos": st.one_of(st.booleans(), junk),
    "stop_token_ids": st.one_of(st.lists(ints, max_size=3), junk),
    "stop": st.one_of(st.lists(st.text(min_size=0, max_size=4), max_size=3), junk),
}
params = st.fixed_dictionaries({}, optional={**values, "bogus": junk})
sampling = st.one_of(
    params.map(json.dumps),
    st.text(max_size=20),  # malformed JSON, mostly
    st.sampled_from(["[]", "null", "1", '"x"', '{"max_tokens": 3,}']),
)
prompt_text = st.one_of(st.text(max_size=40), st.just(""), st.just("x" * 5000))
prompt_ids = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
    st.lists(st.integers(-5, 10**12), max_size=6),
    st.just([]),
    st.just([7] * 5000),
)


@pytest.fixture(scope="module")
def fuzz_server(tiny_server):
    """The shared random:tiny-test server (tests/server/conftest.py)."""
    return tiny_server


def names_a_field(message: str) -> bool:
    """The message is a refusal that names one of the request's fields: not an exception escaping a role (its
    traceback would name whatever it passed through)."""
    if "Failed to process the request" in message or "\nAt:\n" in message or "Traceback" in message:
        return False
    words = set(message.replace("'", " ").replace('"', " ").replace(":", " ").replace(",", " ").split())
    return bool(words & FIELDS)


def bounded(p: dict) -> dict:
    """A valid request must end soon: cap the answer (the fuzz is about what is refused, not long answers)."""
    m = p.get("max_tokens")
    if isinstance(m, str):  # numbers as strings are taken too ("16", as Triton's vLLM backend takes them)
        try:
            m = int(m.strip())
        except ValueError:
            return p
    if isinstance(m, int) and not isinstance(m, bool) and m > 24:
        p = {**p, "max_tokens": 24}
    return p


def tensor(name: str, arr: np.ndarray, dtype: str):
    x = grpcclient.InferInput(name, list(arr.shape), dtype)
    x.set_data_from_numpy(arr)
    return x


@st.composite
def grpc_inputs(draw):
    """A gRPC request: the usual inputs with random values, sometimes of the wrong type or shape."""
    inputs = []
    if draw(st.booleans()):
        inputs.append(tensor("text_input", np.array([draw(prompt_text).encode()], dtype=np.object_), "BYTES"))
    if draw(st.booleans()) or not inputs:
        ids = draw(prompt_ids)
        kind = draw(st.sampled_from(["INT64", "INT64", "FP32", "BYTES", "INT64-2D"]))
        if kind == "FP32":
            inputs.append(tensor("input_ids", np.array(ids, dtype=np.float32), "FP32"))
        elif kind == "BYTES":
            inputs.append(tensor("input_ids", np.array([b"1 2 3"], dtype=np.object_), "BYTES"))
        else:
            arr = np.array([min(max(i, -(2**63)), 2**63 - 1) for i in ids], dtype=np.int64)
            inputs.append(tensor("input_ids", arr.reshape(1, -1) if kind == "INT64-2D" else arr, "INT64"))
    raw = draw(sampling)
    try:
        raw = json.dumps(bounded(json.loads(raw)))
    except (ValueError, TypeError, AttributeError):
        pass
    inputs.append(tensor("sampling_parameters", np.array([raw.encode()], dtype=np.object_), "BYTES"))
    flag = draw(st.sampled_from(["bool", "bool", "int", "absent"]))
    if flag == "bool":
        inputs.append(tensor("stream", np.array([True]), "BOOL"))
    elif flag == "int":
        inputs.append(tensor("stream", np.array([1], dtype=np.int64), "INT64"))
    if draw(st.booleans()):
        inputs.append(tensor("apply_chat_template", np.array([True]), "BOOL"))
    return inputs


def check_grpc(url: str, inputs: list) -> None:
    """An error naming a field, or tokens with no error (read until the answer ends or 3 tokens, then cancel)."""
    c = StreamClient(url, inputs=inputs)
    try:
        r = c.read(until_tokens=3, timeout=60)
    finally:
        c.cancel()
    if r.error is not None:
        assert names_a_field(r.error), r.error
    else:
        assert r.ids or r.finish_reason is not None, r


@SETTINGS
@given(inputs=grpc_inputs())
def test_fuzzed_grpc_requests_are_answered_or_refused_naming_a_field(fuzz_server, inputs):
    check_grpc(fuzz_server.grpc_url, inputs)


# Triton's generate endpoint turns the JSON body into the model's tensors and parameters itself, and answers a
# value its converter does not take (null or a number for a string input, a list as a parameter) with its own
# error (HTTP 500 "Unable to parse JSON bytes array") before pd_master sees the request: the bodies here keep
# each field's JSON type and fuzz the values (gRPC above also fuzzes the types, which Triton refuses naming the
# input).
scalars = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(-1e6, 1e6), st.text(max_size=8))
http_params = st.fixed_dictionaries(
    {}, optional={**{k: scalars for k in values}, "max_tokens": st.integers(-2, 24), "bogus": scalars}
)


@st.composite
def http_bodies(draw):
    body = {}
    if draw(st.booleans()):
        body["text_input"] = draw(prompt_text)
    if draw(st.booleans()) or not body:
        body["input_ids"] = draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6) | prompt_ids)
    if draw(st.booleans()):
        body["sampling_parameters"] = draw(sampling)
    else:
        body["parameters"] = draw(http_params)
    if isinstance(body.get("parameters"), dict):
        body["parameters"] = bounded(body["parameters"])
    if isinstance(body.get("sampling_parameters"), str):
        try:
            body["sampling_parameters"] = json.dumps(bounded(json.loads(body["sampling_parameters"])))
        except (ValueError, TypeError, AttributeError):
            pass
    if draw(st.booleans()):
        body["stream"] = False  # generate (not generate_stream) answers once
    return body


@SETTINGS
@given(body=http_bodies())
def test_fuzzed_http_requests_are_answered_or_refused_naming_a_field(fuzz_server, body):
    status, text = http_post(fuzz_server.http_url, "/v2/models/pd_master/generate", body)
    if status == 200:
        out = json.loads(text)
        assert "text_output" in out or "output_ids" in out, text
    else:
        assert status == 400, (status, text)  # INVALID_ARG; never a 500 or a dead server
        assert names_a_field(json.loads(text)["error"]), text


@st.composite
def internal_requests(draw):
    """A decode or prefill request shaped as the model declares it (Triton itself refuses other shapes, naming
    the input), with fuzzed values and no key or a wrong one."""
    ids = draw(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=8))
    params = SamplingParams(max_tokens=3)
    if draw(st.booleans()):
        model, enc = "pd_decode", DecodeRequest(draw(st.text(max_size=8)), ids, params).encode("")
    else:
        start = draw(st.integers(0, len(ids) - 1))
        msg = PrefillRequest("r", ids, start, list(range(len(ids) - start)), draw(st.integers(0, 9)),
                             draw(st.booleans()), params, draw(st.text(max_size=12)))  # fmt: skip
        model, enc = "pd_prefill", msg.encode("")
    key = draw(st.one_of(st.none(), st.text(max_size=60)))
    if key is None:
        del enc["internal_key"]
    else:
        enc["internal_key"] = np.array([key.encode()], dtype=np.object_)
    return model, infer_inputs(grpcclient, enc)


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(request=internal_requests())
def test_fuzzed_internal_requests_without_the_key_are_refused(fuzz_server, request):
    model, inputs = request
    if model == "pd_prefill":
        client = grpcclient.InferenceServerClient(fuzz_server.grpc_url)
        try:
            with pytest.raises(Exception, match="internal_key"):
                client.infer(model, inputs)
        finally:
            client.close()
        return
    c = StreamClient(fuzz_server.grpc_url, inputs=inputs, model=model)  # decoupled: the refusal is on the stream
    try:
        r = c.read(timeout=30)
    finally:
        c.cancel()
    assert r.error is not None and "internal_key" in r.error and not r.ids, r


def test_a_chat_template_request_to_a_model_without_one_names_the_field(fuzz_server):
    """Found by the fuzz: the tokenizer's TemplateError escaped pd_master as an internal error with a traceback."""
    r = grpc_generate(fuzz_server.grpc_url, timeout=60, text="hi", chat=True, params={"max_tokens": 2})
    assert r.error is not None and "apply_chat_template" in r.error and names_a_field(r.error), r.error
    status, text = http_post(fuzz_server.http_url, "/v2/models/pd_master/generate",
                             {"text_input": "hi", "apply_chat_template": True})  # fmt: skip
    assert status == 400 and json.loads(text)["error"].startswith("apply_chat_template"), (status, text)


def test_after_the_fuzz_the_server_serves_and_holds_nothing(fuzz_server):
    """Runs after the fuzz tests of this module (file order): counts back to 0, and a plain request works."""
    fuzz_server.assert_released(timeout=30)
    assert fuzz_server.wait_metric("pd_master_inflight_requests", lambda v: v == 0, timeout=30) == 0
    r = grpc_generate(fuzz_server.grpc_url, timeout=60, text="hello", params={"max_tokens": 4, "ignore_eos": True})
    assert r.error is None and len(r.ids) == 4
