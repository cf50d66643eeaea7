"""The OpenAI-compatible front end (`serve --openai-port`), driven with the `openai` Python client against a real
tritonserver: answers equal the offline engine's, streaming, usage counts, stop strings, errors in OpenAI's shape,
and a client that goes away mid-stream cancels its answer."""

from __future__ import annotations

import json

import openai
import pytest

from backends.common.core.request import SamplingParams
from tests.server.client import http_post

pytestmark = pytest.mark.server

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a large city."}]


@pytest.fixture(scope="module")
def oai(server):
    """The shared server (tests/server/conftest.py), which serves the OpenAI API too."""
    return server


@pytest.fixture(scope="module")
def client(oai):
    return openai.OpenAI(base_url=oai.openai_url, api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_chat_equals_the_offline_engine_streamed_or_not(client, engine):
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(MESSAGES))
    want = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_with_stop_seed_and_token_ids(client, engine):
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=16, temperature=0,
                                  stop=["."])  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text
    ids = engine.tokenizer.encode("Once upon a time")
    want = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11))[0]
    r = client.completions.create(model="smollm2", prompt=ids, max_tokens=8, temperature=0.8, top_p=0.9, seed=11)
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    "kw,status,param",
    [
        (dict(max_tokens=-1), 400, "max_tokens"),
        (dict(temperature="hot"), 400, "temperature"),
        (dict(n=2), 400, "n"),
        (dict(logprobs=True), 400, "logprobs"),
        (dict(presence_penalty=0.5), 400, "presence_penalty"),
        (dict(model="gpt-4"), 404, "model"),
    ],
)
def test_errors_have_openai_shape_and_name_the_parameter(oai, kw, status, param):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], **kw}
    code, text = http_post(oai.openai_url.removeprefix("http://"), "/chat/completions", body)
    assert code == status, text
    err = json.loads(text)["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_a_client_that_goes_away_mid_stream_cancels_its_answer(client, oai):
    stream = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2000, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    stream.close()
    oai.assert_released(timeout=15)
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
