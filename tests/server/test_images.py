"""Images through a real tritonserver (a tiny random Qwen3.5 checkpoint with its image processor): pd_master's
`image` input over gRPC and over HTTP's generate endpoint, answers equal to the offline engine's (which equal
transformers', tests/hybrid/test_vision.py), and prefill holding nothing once they end. The roles' image paths
through pauses and recoveries run in-process (tests/inprocess/test_images.py)."""

from __future__ import annotations

import base64
import json

import pytest

from backends.common.core.request import SamplingParams
from tests.hybrid.conftest import make_engine
from tests.hybrid.test_vision import END, IMAGE, START, _save, _word_tokenizer, png
from tests.server.client import grpc_generate, http_post
from tests.server.conftest import openai_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    folder = _save(tmp_path_factory, moe=False)[0]
    _word_tokenizer(folder)  # words t0..t299 and a chat template, for the OpenAI endpoint
    s = openai_server("--model", str(folder), "--kv-tokens", "512", name="images")
    yield s, make_engine(folder)
    s.stop()


def test_images_over_grpc_and_http_equal_the_offline_engine(vl):
    s, engine = vl
    images = [png(84, 56, 1), png(56, 112, 2)]
    ids = [7, 8] + [t for _ in images for t in (START, IMAGE, END)] + [11, 12]
    want = engine.generate([ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), images=[images])
    b64 = [base64.b64encode(x) for x in images]
    params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    r = grpc_generate(s.grpc_url, ids=ids, images=b64, params=params)
    assert r.error is None and r.ids == want[0].output_ids
    body = {
        "input_ids": ids,
        "image": [x.decode() for x in b64],
        "sampling_parameters": json.dumps(params),
        "exclude_input_in_output": True,
    }
    status, text = http_post(s.http_url, "/v2/models/pd_master/generate", body)
    assert status == 200 and json.loads(text)["output_ids"] == want[0].output_ids, text
    assert s.wait_metric("pd_mm_requests_held", lambda v: v == 0, timeout=10) == 0
    assert s.metric("pd_mm_encodes_total") == 2
    bad = grpc_generate(s.grpc_url, ids=ids, images=b64[:1], params=params)
    assert bad.error is not None and "image: 1 image(s) but 2 image placeholder(s)" in bad.error
    s.assert_released(timeout=10)


def test_openai_chat_takes_data_url_images(vl):
    """An image_url part with a PNG data URL, in its place before the text: the answer equals the offline engine's
    for the chat template's ids; an https URL is a 400 naming the part, and nothing is fetched or held."""
    import openai

    s, engine = vl
    image = png(84, 56, 3)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    client = openai.OpenAI(base_url=s.openai_url, api_key="unused", max_retries=0)
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "t7 t8"}]
    r = client.chat.completions.create(model=r_model(client), messages=[{"role": "user", "content": content}],
                                       max_tokens=8, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    ids = [1, START, IMAGE, END, 7, 8, 2]  # the template's t1 ... t2 around the image and the text
    want = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), images=[[image]])[0]
    assert r.usage.prompt_tokens == want.num_prompt_tokens and r.usage.completion_tokens == 8
    assert r.choices[0].message.content == want.text
    content[0]["image_url"]["url"] = "https://example.com/cat.png"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=r_model(client), messages=[{"role": "user", "content": content}])
    assert e.value.body["param"] == "messages[0].content[0].image_url"
    assert s.wait_metric("pd_mm_requests_held", lambda v: v == 0, timeout=10) == 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_generate_sends_image_files(vl, tmp_path, capsys, protocol):
    """`triton-pd generate --url ... --image FILE --chat`: the image goes before the prompt's text (master puts it
    there), and the answer equals the offline engine's."""
    from backends.cli import main

    s, engine = vl
    path = tmp_path / "a.png"
    path.write_bytes(png(56, 84, 4))
    url = s.grpc_url if protocol == "grpc" else s.http_url
    argv = ["generate", "--url", url, "--protocol", protocol, "--chat", "--prompt", "t7 t8", "--image", str(path),
            "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--json"]  # fmt: skip
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)["output_ids"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = [1, START, IMAGE, END, 7, 8, 2]
    assert got == engine.generate([ids], params, images=[[path.read_bytes()]])[0].output_ids


def r_model(client) -> str:
    return client.models.list().data[0].id
