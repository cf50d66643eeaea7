"""End to end through a real tritonserver: master, decode and prefill with BLS, streaming, the KV hand-off."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backends.client import infer_inputs
from backends.common.core.request import SamplingParams
from backends.common.serving.wire import DecodeRequest, PrefillRequest
from tests.server.client import StreamClient, grpc_generate, http_post

pytestmark = pytest.mark.server

PROMPTS = [
    "The history of the Roman Empire",
    "def quicksort(arr):",
    "Once upon a time, in a small village",
    "The three laws of thermodynamics are",
    "My favourite recipe for bread",
    "import numpy as np\n",
    "Dear Sir or Madam,",
    "The capital of Japan is",
]


def greedy(n: int) -> dict:
    return {"max_tokens": n, "temperature": 0, "ignore_eos": True}


def test_eight_concurrent_streams_equal_offline_engine(server, engine):
    n = 24
    expected = engine.generate(
        [engine.tokenizer.encode(p) for p in PROMPTS], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    )
    results = [None] * len(PROMPTS)

    def run(i):
        results[i] = grpc_generate(server.grpc_url, text=PROMPTS[i], params=greedy(n))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for res, exp in zip(results, expected):
        assert res.error is None
        assert res.ids == exp.output_ids  # every token, in order, none twice
        assert res.text == exp.text
        assert res.finish_reason == "length"


def test_http_generate_stream_same_text(server, engine):
    prompt = "What is the capital of France?"
    exp = engine.generate([engine.tokenizer.encode_chat(prompt)], SamplingParams(max_tokens=30, temperature=0))[0]
    status, body = http_post(
        server.http_url,
        "/v2/models/pd_master/generate_stream",
        {
            "text_input": prompt,
            "apply_chat_template": True,
            "stream": True,
            "sampling_parameters": json.dumps({"max_tokens": 30, "temperature": 0}),
        },
    )
    assert status == 200
    events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]
    assert len(events) >= 2  # streamed, not one block
    assert "".join(e["text_output"] for e in events) == exp.text == "The capital of France is Paris."
    # Triton's generate extension writes a one-element output as a scalar
    assert (
        sum((e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]] for e in events), [])
        == exp.output_ids
    )
    assert events[-1]["finish_reason"] == "stop"


def test_non_streaming_and_exclude_input(server, engine):
    ids = engine.tokenizer.encode("Paris is")
    exp = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    full = grpc_generate(server.grpc_url, text="Paris is", params=greedy(8), stream=False)
    assert full.responses == 1 and full.finish_reason == "length"
    assert full.text == "Paris is" + exp.text and full.ids == ids + exp.output_ids
    excl = grpc_generate(server.grpc_url, text="Paris is", params=greedy(8), stream=False, exclude_input=True)
    assert excl.text == exp.text and excl.ids == exp.output_ids
    status, body = http_post(
        server.http_url,
        "/v2/models/pd_master/generate",
        {"text_input": "Paris is", "exclude_input_in_output": True, "sampling_parameters": json.dumps(greedy(8))},
    )
    assert status == 200 and json.loads(body)["text_output"] == exp.text


def test_input_ids_input(server, engine):
    ids = engine.tokenizer.encode("The quick brown fox")
    exp = engine.generate([ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    res = grpc_generate(server.grpc_url, ids=ids, params=greedy(10))
    assert res.ids == exp.output_ids and res.text == exp.text


def test_seeded_sampling_matches_offline(server, engine):
    ids = engine.tokenizer.encode_chat("Tell me a joke.")
    p = {"max_tokens": 20, "temperature": 0.8, "top_p": 0.9, "seed": 42, "ignore_eos": True}
    exp = engine.generate([ids], SamplingParams(**p))[0]
    res = grpc_generate(server.grpc_url, ids=ids, params=p)
    assert res.ids == exp.output_ids


def test_stop_string_cuts_text(server, engine):
    ids = engine.tokenizer.encode_chat("What is the capital of France?")
    res = grpc_generate(server.grpc_url, ids=ids, params={"max_tokens": 30, "temperature": 0, "stop": ["Paris"]})
    assert res.text == "The capital of France is " and res.finish_reason == "stop"


def _idle(server):
    running = server.wait_metric("pd_decode_running_requests", lambda v: v == 0, timeout=2.0)
    used = server.wait_metric("pd_kv_slots_used", lambda v: v == 0, timeout=2.0)
    return running, used


def test_cancel_four_streams_frees_everything(server):
    clients = [StreamClient(server.grpc_url, text=p, params=greedy(400)) for p in PROMPTS[:4]]
    for c in clients:
        assert c.read(until_tokens=3).error is None
    assert server.metric("pd_decode_running_requests") > 0
    t0 = time.monotonic()
    for c in clients:
        c.cancel()
    running, used = _idle(server)
    assert running == 0 and used == 0, f"after {time.monotonic() - t0:.2f}s"
    assert server.metric("pd_decode_queued_requests") == 0
    res = grpc_generate(server.grpc_url, text="Hello", params=greedy(4))
    assert res.error is None and len(res.ids) == 4


def _direct(server, model: str, inputs) -> str:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        if model == "pd_prefill":
            client.infer(model, inputs)
            return ""
        q = []
        client.start_stream(callback=lambda result, error: q.append(error))
        client.async_stream_infer(model, inputs)
        t0 = time.monotonic()
        while not q and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        client.stop_stream()
        return str(q[0]) if q and q[0] is not None else ""
    except Exception as e:
        return str(e)
    finally:
        client.close()


def test_internal_models_refuse_requests_without_key(server):
    jobs_before = server.metric("pd_prefill_jobs_total")
    params = SamplingParams(max_tokens=3)
    enc = PrefillRequest("x", [1, 2, 3], 0, [0, 1, 2], 0, True, params, "{}").encode("")
    del enc["internal_key"]
    prefill_inputs = infer_inputs(grpcclient, enc)
    msg = _direct(server, "pd_prefill", prefill_inputs)
    assert "internal_key" in msg and "internal model" in msg
    wrong = infer_inputs(grpcclient, {**enc, "internal_key": np.array([b"guess"], dtype=np.object_)})
    assert "does not match" in _direct(server, "pd_prefill", wrong)
    dec = DecodeRequest("y", [1, 2, 3], params).encode("")
    del dec["internal_key"]
    msg = _direct(server, "pd_decode", infer_inputs(grpcclient, dec))
    assert "internal_key" in msg and "internal model" in msg
    assert server.metric("pd_prefill_jobs_total") == jobs_before  # nothing ran
    assert server.metric("pd_decode_running_requests") == 0 and server.metric("pd_kv_slots_used") == 0


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(text="hi", params={"max_tokens": -1}), "max_tokens"),
        (dict(text="hi", params={"temperature": -0.5}), "temperature"),
        (dict(text="hi", params={"top_p": 1.5}), "top_p"),
        (dict(text="hi", params={"top_p": 0}), "top_p"),
        (dict(text="hi", raw_params="{not json"), "sampling_parameters"),
        (dict(text="hi", params={"max_tokens": 4, "bogus": 1}), "sampling_parameters"),
        (dict(text="hi", ids=[1, 2]), "text_input"),
        (dict(params={"max_tokens": 4}), "text_input"),
        (dict(text="word " * 9000, params={"max_tokens": 4}), "text_input"),
        (dict(ids=[10**9], params={"max_tokens": 4}), "input_ids"),
    ],
)
def test_bad_input_invalid_arg_names_field(server, kw, field):
    # gRPC stream responses carry an error message but no status code: the message must name the field
    res = grpc_generate(server.grpc_url, **kw)
    assert res.error is not None and res.error.split(": ", 1)[1].startswith(field), res.error
    assert server.healthy()


@pytest.mark.parametrize(
    "body,field",
    [
        ({"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": -1})}, "max_tokens"),
        ({"text_input": "hi", "sampling_parameters": json.dumps({"top_p": 2})}, "top_p"),
        ({"text_input": "hi", "sampling_parameters": "{oops"}, "sampling_parameters"),
        ({"text_input": "hi", "parameters": {"temperature": -1}}, "temperature"),
        ({"text_input": "hi", "image": ["data:image/png;base64,iVBORw0KGgo="]}, "image"),
        ({"text_input": "hi", "parameters": {"image_url": "https://example.com/cat.png"}}, "image_url"),
    ],
)
def test_http_bad_input_is_400_invalid_arg(server, body, field):
    status, text = http_post(server.http_url, "/v2/models/pd_master/generate", body)
    assert status == 400, (status, text)  # Triton maps INVALID_ARG to HTTP 400
    assert json.loads(text)["error"].startswith(field)


def test_serves_after_bad_input(server):
    res = grpc_generate(server.grpc_url, text="Hello", params=greedy(3))
    assert res.error is None and len(res.ids) == 3


def test_perf_analyzer_runs_as_printed(server, tmp_path):
    """`bench to-perf-analyzer`'s files and the command it prints drive the server with Triton's perf_analyzer
    (through `triton-pd perf-analyzer`, which resolves the CUDA runtime library the binary links): exit status 0,
    every request counted, and decode holds nothing afterwards."""
    import shlex
    import subprocess

    from backends import replay

    reqs = [replay.TraceRequest(arrival=0.05 * i, input_len=6, output_len=4) for i in range(6)]
    prompts = [[72 + i, 101, 108, 108, 111, 32] for i in range(6)]
    inp, iv = replay.to_perf_analyzer(reqs, prompts, tmp_path)
    cmd = replay.perf_analyzer_command(server.grpc_url, inp, iv, len(reqs), tmp_path)
    assert " perf-analyzer -m pd_master " in cmd
    r = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Request count: 6" in r.stdout, r.stdout[-2000:]
    assert json.loads((tmp_path / "pa_profile.json").read_text())["experiments"][0]["requests"]
    server.assert_released(timeout=10)


def test_sampling_values_as_strings_are_taken_as_the_vllm_backend_takes_them(server):
    """genai-perf sends {"max_tokens": "16"}: numbers (and booleans) as strings convert; one that does not is
    refused naming its key."""
    res = grpc_generate(server.grpc_url, text="Hello", params={"max_tokens": "3", "temperature": "0",
                                                               "ignore_eos": "true"})  # fmt: skip
    assert res.error is None and len(res.ids) == 3
    assert res.ids == grpc_generate(server.grpc_url, text="Hello", params=greedy(3)).ids
    bad = grpc_generate(server.grpc_url, text="Hello", params={"max_tokens": "three"})
    assert bad.error is not None and "max_tokens" in bad.error


def test_process_rss_and_metrics_as_the_soak_reads_them(server):
    """What `perf/soak.py steady` writes per window: the RSS of tritonserver and of every Python stub (one instance
    of each role here), found from the launcher's pid, and several metrics at once with 0 for a counter not yet
    touched."""
    rss = server.process_rss()
    assert set(rss) == {"tritonserver", "pd_master_0_0", "pd_decode_0_0", "pd_prefill_0_0"}, rss
    assert all(v > 10 << 20 for v in rss.values()), rss  # each a live process of more than 10 MB
    got = server.read_metrics({"total": "pd_kv_slots_total", "absent": ("pd_no_such_metric", {"path": "x"})})
    assert got == {"total": 4096.0, "absent": 0.0}


def test_endpoints_bind_only_the_address_given(server):
    """`--address 127.0.0.1` (what tests and scripts start servers with, and `make serve`): HTTP, gRPC and metrics
    answer at that address and refuse a connection at another address of this host (127.0.0.2, also loopback),
    which every-interface binding (0.0.0.0, Triton's default) would accept."""
    import socket

    for port in (server.http, server.grpc, server.metrics):
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
