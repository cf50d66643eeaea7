"""The reply channel between decode and master (a Unix socket beside each BLS stream), in-process."""

from __future__ import annotations

import queue
import socket
import time

import pytest

from backends.common.serving.reply_channel import (
    ReplyChannel,
    ReplyChannels,
    ReplyInbox,
    _frame,
    parse_record,
    record,
    socket_path,
)
from backends.common.serving.wire import DecodeResponse

KEY = "k" * 32


@pytest.fixture
def inbox(tmp_path):
    box = ReplyInbox(socket_path(str(tmp_path), "pd_master_0_0"), KEY)
    yield box
    box.close()


def test_parts_reach_the_queue_of_the_request_they_name_in_order(inbox, tmp_path):
    qa, qb = inbox.open("a"), inbox.open("b")
    ch = ReplyChannels(str(tmp_path), KEY).get(inbox.path)
    ch.send([("a", DecodeResponse([1, 2])), ("b", DecodeResponse([7]))])
    ch.send([("gone", DecodeResponse([9])), ("a", DecodeResponse([3], "length", num_pauses=2))])
    ch.send([("b", DecodeResponse(error="boom", error_code="UNAVAILABLE"))])
    assert [qa.get(timeout=5), qa.get(timeout=5)] == [
        DecodeResponse([1, 2]),
        DecodeResponse([3], "length", None, "INTERNAL", 2),
    ]
    assert qb.get(timeout=5) == DecodeResponse([7])
    err = qb.get(timeout=5)
    assert err.final and err.error == "boom" and err.error_code == "UNAVAILABLE"
    with pytest.raises(queue.Empty):  # the part for a request nobody opened went nowhere
        qa.get(timeout=0.2)
    ch.close()


def test_a_connection_without_the_key_delivers_nothing(inbox):
    q = inbox.open("a")
    ch = ReplyChannel(inbox.path, "wrong")
    t0 = time.monotonic()
    with pytest.raises(OSError):  # master closes the connection after the bad hello: sending then fails
        while time.monotonic() - t0 < 5:
            ch.send([("a", DecodeResponse([1]))])
            time.sleep(0.01)
    assert ch.broken
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(inbox.path)
    raw.sendall(_frame({"r": [record("a", DecodeResponse([5]))]}))  # no hello at all
    raw.close()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.3)


def test_a_discarded_request_gets_nothing_more(inbox, tmp_path):
    q = inbox.open("a")
    inbox.discard("a")
    ch = ReplyChannels(str(tmp_path), KEY).get(inbox.path)
    ch.send([("a", DecodeResponse([1]))])
    with pytest.raises(queue.Empty):
        q.get(timeout=0.3)
    ch.close()


def test_decode_connects_only_to_sockets_of_its_own_deployment(tmp_path):
    chans = ReplyChannels(str(tmp_path), KEY)
    assert chans.check(str(tmp_path / "pd_master_0_0.sock")) == str(tmp_path / "pd_master_0_0.sock")
    for bad in ("/tmp/other/pd_master.sock", str(tmp_path / "x.txt"), "pd_master.sock", str(tmp_path / "../a.sock")):
        with pytest.raises(ValueError, match="reply_to"):
            chans.check(bad)


@pytest.mark.parametrize(
    "rec",
    [["a", [1], None, None, "", 0, "extra"], ["a", [1.5], None, None, "", 0], [1, [1], None, None, "", 0],
     ["a", [1], 3, None, "", 0], ["a", [1], None, None, "", "0"], {"rid": "a"}],
)  # fmt: skip
def test_malformed_records_are_refused(rec):
    with pytest.raises(ValueError):
        parse_record(rec)


def test_a_record_round_trips():
    r = DecodeResponse([4, 5], "stop", num_pauses=3)
    assert parse_record(record("x.1", r)) == ("x.1", r)
