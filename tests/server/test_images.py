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
from tests.hybrid.test_vision import END, IMAGE, START, _save, png
from tests.server.client import grpc_generate, http_post
from tests.server.conftest import Server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    folder = _save(tmp_path_factory, moe=False)[0]
    s = Server("--model", str(folder), "--kv-tokens", "512", name="images")
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
