"""Every tensor a role writes or reads is declared in the config.pbtxt of the model that receives or sends it, with
the same name, data type and shape; every input a model requires is sent. Checked from the wire dataclasses'
encodings and a getter that records what their decoders read, against the config files as Triton reads them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backends.common.core.request import SamplingParams
from backends.common.serving.wire import (
    TRITON_DTYPES,
    DecodeRequest,
    DecodeResponse,
    MasterRequest,
    PrefillRequest,
    PrefillResponse,
)

REPO = Path(__file__).resolve().parents[2] / "model_repository"
KEY = "k" * 48
_TENSOR = re.compile(
    r'\{\s*name:\s*"(?P<name>\w+)"\s+data_type:\s*TYPE_(?P<type>\w+)\s+dims:\s*\[(?P<dims>[^\]]*)\]'
    r"(?P<optional>\s+optional:\s*true)?\s*\}"
)
_PBTXT_TYPES = {"INT64": "INT64", "BOOL": "BOOL", "STRING": "BYTES"}  # config.pbtxt names -> client dtype names


def declared(model: str, repo: Path = REPO) -> dict[str, dict[str, dict]]:
    """{"input": {name: {type, dims, optional}}, "output": {...}} of <repo>/<model>/config.pbtxt."""
    text = (repo / model / "config.pbtxt").read_text()
    out = {}
    for kind in ("input", "output"):
        block = re.search(rf"^{kind} \[(.*?)^\]", text, re.S | re.M)
        assert block, f"{model}: no {kind} block"
        out[kind] = {
            m["name"]: {
                "type": _PBTXT_TYPES[m["type"]],
                "dims": [int(d) for d in m["dims"].split(",")],
                "optional": bool(m["optional"]),
            }
            for m in _TENSOR.finditer(block.group(1))
        }
        assert len(out[kind]) == block.group(1).count("name:"), f"{model}: a {kind} line the pattern missed"
    return out


def check_tensors(model: str, kind: str, tensors: dict, repo: Path = REPO) -> None:
    decl = declared(model, repo)[kind]
    for name, arr in tensors.items():
        assert name in decl, f"{model}: {kind} {name!r} is not declared"
        assert TRITON_DTYPES[arr.dtype] == decl[name]["type"], (model, name, arr.dtype, decl[name]["type"])
        dims = decl[name]["dims"]
        assert arr.ndim == len(dims) and all(d in (-1, n) for d, n in zip(dims, arr.shape)), (model, name, arr.shape)


class Recorder:
    """A getter over encoded tensors that records every name a decoder asks for."""

    def __init__(self, tensors: dict):
        self.tensors, self.asked = tensors, set()

    def __call__(self, name: str):
        self.asked.add(name)
        return self.tensors.get(name)


PREFILL = dict(request_id="r", input_ids=[1, 2, 3], start=1, dst_slots=[4, 5], epoch=2, sample=True,
               params=SamplingParams(max_tokens=3), kv_handle="{}")  # fmt: skip


@pytest.mark.parametrize(
    "msg",
    [
        DecodeRequest("r", [1, 2], SamplingParams(max_tokens=4)),
        DecodeRequest("r", [], SamplingParams(), cancel="timeout"),
        DecodeRequest("r", [1, 2], SamplingParams(), reply_to="/dev/shm/triton-pd-x/pd_master_0.sock"),
        PrefillRequest(**PREFILL),
        PrefillRequest(**PREFILL, state_handle="{}", dst_state_page=3),
    ],
    ids=["decode", "decode-cancel", "decode-reply", "prefill", "prefill-hybrid"],
)
def test_internal_requests_match_the_receivers_inputs(msg):
    model = type(msg).MODEL
    enc = msg.encode(KEY)
    check_tensors(model, "input", enc)
    decl = declared(model)["input"]
    if not getattr(msg, "cancel", ""):  # a cancel notice carries only what names the request
        assert {n for n, d in decl.items() if not d["optional"]} <= set(enc), model
    got = Recorder(enc)
    assert type(msg).decode(got, KEY) == msg
    assert got.asked <= set(decl), (model, got.asked - set(decl))


@pytest.mark.parametrize(
    "msg",
    [DecodeResponse([5, 6]), DecodeResponse([], "stop", num_pauses=2), DecodeResponse(error="boom", error_code="X"),
     PrefillResponse(3, 17), PrefillResponse(4)],
)  # fmt: skip
def test_responses_match_the_senders_outputs(msg):
    model = "pd_decode" if isinstance(msg, DecodeResponse) else "pd_prefill"
    enc = msg.encode()
    check_tensors(model, "output", enc)
    # the names the caller requests are exactly what the model declares and sends
    requested = DecodeResponse.OUTPUTS if model == "pd_decode" else PrefillRequest.OUTPUTS
    assert set(requested) == set(declared(model)["output"]) == set(enc), model
    got = Recorder(enc)
    assert type(msg).decode(got) == msg and got.asked <= set(requested)


@pytest.mark.parametrize(
    "msg",
    [MasterRequest(text="hi", params={"max_tokens": 4}), MasterRequest(ids=[1, 2], stream=False, exclude_input=True),
     MasterRequest(text="hi", chat=True, raw_params="{")],
)  # fmt: skip
def test_client_requests_match_the_masters_inputs(msg):
    enc = msg.encode()
    check_tensors("pd_master", "input", enc)
    assert set(MasterRequest.OUTPUTS) == set(declared("pd_master")["output"])


def test_the_master_reads_only_declared_inputs():
    """pd_master reads its inputs through triton_io by literal name: each name it reads is declared."""
    source = (Path(__file__).resolve().parents[2] / "backends" / "pd_master" / "model.py").read_text()
    read = set(re.findall(r'tio\.input_\w+\(request, "(\w+)"', source))
    assert {"text_input", "input_ids", "sampling_parameters", "stream"} <= read, read
    assert read <= set(declared("pd_master")["input"]), read - set(declared("pd_master")["input"])
    written = set(re.findall(r'tio\.tensor\("(\w+)"', source))
    assert written == set(MasterRequest.OUTPUTS), written


def test_the_check_sees_a_drifted_declaration(tmp_path):
    """The check can fail: a config whose type or shape drifted from the encoding is caught."""
    drifts = [
        ('"epoch" data_type: TYPE_INT64', '"epoch" data_type: TYPE_STRING'),  # type
        ('"input_ids" data_type: TYPE_INT64 dims: [ -1 ]', '"input_ids" data_type: TYPE_INT64 dims: [ 2 ]'),  # shape
        ('"sample"', '"sample_token"'),  # name
    ]
    for old, new in drifts:
        (tmp_path / "pd_prefill").mkdir(exist_ok=True)
        text = (REPO / "pd_prefill" / "config.pbtxt").read_text()
        assert old in text
        (tmp_path / "pd_prefill" / "config.pbtxt").write_text(text.replace(old, new, 1))
        with pytest.raises(AssertionError):
            check_tensors("pd_prefill", "input", PrefillRequest(**PREFILL).encode(KEY), tmp_path)
