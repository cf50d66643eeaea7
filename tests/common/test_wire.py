"""The wire contracts between master, decode and prefill: each message survives its own encoding exactly, every
malformed field is refused with a ParamError naming it, and internal requests without the key are refused first."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backends.common.core.request import ParamError, SamplingParams
from backends.common.serving.streaming import Item, Stream, StreamSender
from backends.common.serving.wire import DecodeRequest, DecodeResponse, PrefillRequest, PrefillResponse

KEY = "k" * 48


def getter(tensors: dict):
    return tensors.get


def prefill_msg(**kw) -> PrefillRequest:
    base = dict(
        request_id="r1",
        input_ids=[5, 6, 7, 2**40],
        start=1,
        dst_slots=[10, 11, 12],
        epoch=3,
        sample=False,
        params=SamplingParams(max_tokens=9, temperature=0.7, top_k=5, seed=2**62, stop=["\n"]),
        kv_handle=json.dumps({"kind": "shm", "name": "tpd_x"}),
    )
    return PrefillRequest(**{**base, **kw})


def test_decode_request_round_trip_keeps_int64_ids_and_params():
    msg = DecodeRequest("abc", [1, 2**40, 3], SamplingParams(max_tokens=4, seed=7, stop_token_ids=[9]))
    enc = msg.encode(KEY)
    assert enc["input_ids"].dtype == np.int64 and enc["request_id"].dtype == np.object_
    assert DecodeRequest.decode(getter(enc), KEY) == msg


def test_decode_cancel_notice_round_trip_needs_the_key_and_a_request_id():
    """A master in another server cancels through decode's own model: the notice names the request."""
    enc = DecodeRequest("abc", [], SamplingParams(), cancel="timeout").encode(KEY)
    assert "cancel" in enc and "cancel" not in DecodeRequest("abc", [1], SamplingParams()).encode(KEY)
    got = DecodeRequest.decode(getter(enc), KEY)
    assert (got.request_id, got.cancel, got.input_ids) == ("abc", "timeout", [])
    with pytest.raises(ParamError) as e:
        DecodeRequest.decode(getter({**enc, "request_id": np.array([b""], dtype=np.object_)}), KEY)
    assert e.value.field == "request_id"
    with pytest.raises(ParamError, match="does not match"):
        DecodeRequest.decode(getter(enc), "another deployment")


@pytest.mark.parametrize("cls", [DecodeRequest, PrefillRequest])
def test_internal_requests_refuse_a_missing_or_wrong_key_before_anything_else(cls):
    enc = (DecodeRequest("a", [1], SamplingParams()) if cls is DecodeRequest else prefill_msg()).encode(KEY)
    del enc["internal_key"]
    enc["input_ids"] = np.array([], dtype=np.int64)  # also malformed: the key is still what is reported
    with pytest.raises(ParamError, match="internal model") as e:
        cls.decode(getter(enc), KEY)
    assert e.value.field == "internal_key"
    enc["internal_key"] = np.array([b"guess"], dtype=np.object_)
    with pytest.raises(ParamError, match="does not match"):
        cls.decode(getter(enc), KEY)


def test_decode_request_refuses_missing_ids_and_bad_sampling_json():
    enc = DecodeRequest("a", [1, 2], SamplingParams()).encode(KEY)
    with pytest.raises(ParamError) as e:
        DecodeRequest.decode(getter({**enc, "input_ids": np.array([], dtype=np.int64)}), KEY)
    assert e.value.field == "input_ids"
    with pytest.raises(ParamError) as e:
        DecodeRequest.decode(getter({**enc, "sampling_parameters": np.array([b"{"], dtype=np.object_)}), KEY)
    assert e.value.field == "sampling_parameters"
    with pytest.raises(ParamError) as e:
        bad = json.dumps({"temperature": -1}).encode()
        DecodeRequest.decode(getter({**enc, "sampling_parameters": np.array([bad], dtype=np.object_)}), KEY)
    assert e.value.field == "temperature"


def test_prefill_request_round_trip():
    msg = prefill_msg()
    assert PrefillRequest.decode(getter(msg.encode(KEY)), KEY) == msg
    prompt = prefill_msg(start=0, dst_slots=[1, 2, 3, 4], epoch=0, sample=True)
    assert PrefillRequest.decode(getter(prompt.encode(KEY)), KEY) == prompt


@pytest.mark.parametrize(
    "kw,field_name",
    [
        (dict(start=4), "dst_slots"),  # start past the end
        (dict(start=-1), "dst_slots"),
        (dict(dst_slots=[1, 2]), "dst_slots"),  # one slot short of [start, end)
        (dict(epoch=-1), "epoch"),
        (dict(input_ids=[], start=0, dst_slots=[]), "input_ids"),
    ],
)
def test_prefill_request_refuses_inconsistent_fields(kw, field_name):
    with pytest.raises(ParamError) as e:
        prefill_msg(**kw)
    assert e.value.field == field_name
    # the same fields arriving over the wire are refused by decode() the same way
    enc = prefill_msg().encode(KEY)
    for name, value in kw.items():
        if name in ("start", "epoch"):
            enc[name] = np.array([value], dtype=np.int64)
        elif name in ("dst_slots", "input_ids"):
            enc[name] = np.array(value, dtype=np.int64)
    with pytest.raises(ParamError) as e:
        PrefillRequest.decode(getter(enc), KEY)
    assert e.value.field == field_name


def test_prefill_request_refuses_missing_and_multi_valued_scalars():
    enc = prefill_msg().encode(KEY)
    for name in ("start", "epoch", "dst_slots", "kv_handle"):
        with pytest.raises(ParamError) as e:
            PrefillRequest.decode(getter({k: v for k, v in enc.items() if k != name}), KEY)
        assert e.value.field == name
    with pytest.raises(ParamError, match="one integer") as e:
        PrefillRequest.decode(getter({**enc, "epoch": np.array([1, 2], dtype=np.int64)}), KEY)


def test_prefill_response_round_trip_distinguishes_no_token():
    for r in (PrefillResponse(4, 17), PrefillResponse(0, 0), PrefillResponse(9, None)):
        assert PrefillResponse.decode(getter(r.encode())) == r


def test_decode_response_round_trip_tokens_finish_and_error():
    for r in (
        DecodeResponse([1, 2, 3]),
        DecodeResponse([4], "length", num_pauses=2),
        DecodeResponse([], "cancelled"),
        DecodeResponse([], None, "input_ids: never fits", "INVALID_ARG", num_pauses=1),
    ):
        back = DecodeResponse.decode(getter(r.encode()))
        assert back == r
        assert back.final == (r.finish_reason is not None or r.error is not None)
    # an error's tokens are never sent, and the closing response without outputs decodes to None
    assert DecodeResponse([5], None, "boom").encode()["output_ids"].size == 0
    assert DecodeResponse.decode(getter({})) is None


def test_stream_sender_merges_pending_parts_and_sends_nothing_after_final():
    a, b = Stream("a", None), Stream("b", None)
    items = [
        Item(a, DecodeResponse([1])),
        Item(b, DecodeResponse([7])),
        Item(a, DecodeResponse([2], num_pauses=1)),
        Item(a, DecodeResponse([3], "stop", num_pauses=1)),
        Item(a, DecodeResponse([4])),  # after a's final part: dropped
        Item(b, DecodeResponse([], None, "gone", "CANCELLED")),
    ]
    merged = StreamSender.merge(items)
    assert [s for s, _ in merged] == [a, b]
    assert merged[0][1] == DecodeResponse([1, 2, 3], "stop", num_pauses=1)
    assert merged[1][1] == DecodeResponse([7], None, "gone", "CANCELLED")
    assert items[0].response.output_ids == [1]  # the parts pushed are not modified

    sent = []
    sender = StreamSender(lambda stream, resp: sent.append((stream.rid, resp)))
    for it in items:
        sender.push(it)
    sender.close()
    finals = [rid for rid, resp in sent if resp.final]
    assert sorted(finals) == ["a", "b"] and a.closed and b.closed
    ids_a = [t for rid, resp in sent if rid == "a" for t in resp.output_ids]
    assert ids_a == [1, 2, 3]  # however the thread batched them: in order, no duplicate, nothing after final


def test_sampling_values_as_strings_convert_as_the_vllm_backend_takes_them():
    """genai-perf sends {"max_tokens": "16"}; Triton's vLLM backend converts such strings, and so do we. A string
    that does not convert is refused naming its key."""
    p = SamplingParams.from_json(
        json.dumps(
            {"max_tokens": "16", "temperature": "0", "top_p": " 0.5", "top_k": "-1", "seed": "7", "min_tokens": "2",
             "ignore_eos": "True", "stop_token_ids": ["5", 6]}
        )
    )  # fmt: skip
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.min_tokens) == (16, 0.0, 0.5, -1, 7, 2)
    assert p.ignore_eos is True and p.stop_token_ids == [5, 6]
    assert SamplingParams.from_json('{"ignore_eos": "false", "max_tokens": 8.0}').ignore_eos is False
    for key, value in [
        ("max_tokens", "16.5"), ("max_tokens", "lots"), ("temperature", "warm"), ("temperature", "nan"),
        ("top_p", "inf"), ("ignore_eos", "maybe"), ("stop_token_ids", ["x"]), ("seed", "-1"), ("max_tokens", "0"),
    ]:  # fmt: skip
        with pytest.raises(ParamError) as e:
            SamplingParams.from_json(json.dumps({key: value}))
        assert e.value.field == key, (key, value)
