"""``read_pub_ack``: how a JetStream publish's answer is sorted, for the log append and the lease
create alike."""

from __future__ import annotations

import pytest

from apomesh.adapters.nats_connect import read_pub_ack
from apomesh.core.errors import LogError


def test_a_stored_message_gives_its_sequence() -> None:
    ack = read_pub_ack(b'{"stream":"APOMESH_LOG","seq":42}', "append")
    assert (ack.seq, ack.duplicate, ack.error) == (42, False, None)


def test_a_duplicate_is_said() -> None:
    ack = read_pub_ack(b'{"stream":"APOMESH_LOG","seq":7,"duplicate":true}', "append")
    assert ack.duplicate and ack.seq == 7


@pytest.mark.parametrize("err_code", [10071, 10164])
def test_a_wrong_last_sequence_is_said(err_code: int) -> None:
    answer = b'{"error":{"code":400,"err_code":%d,"description":"wrong last sequence: 5"}}'
    ack = read_pub_ack(answer % err_code, "lease s1")
    assert ack.wrong_last_sequence and not ack.transient


@pytest.mark.parametrize(
    "error",
    [
        b'{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}',
        b'{"code":400,"err_code":10158,"description":"duplicate message id is in process"}',
        b'{"code":400,"err_code":1,"description":"inflight limit reached"}',
    ],
)
def test_a_refusal_for_now_is_transient(error: bytes) -> None:
    ack = read_pub_ack(b'{"error":' + error + b"}", "append")
    assert ack.transient and not ack.wrong_last_sequence


def test_a_refusal_for_good_names_its_code() -> None:
    answer = b'{"error":{"code":400,"err_code":10054,"description":"maximum messages exceeded"}}'
    ack = read_pub_ack(answer, "append")
    assert not ack.transient and not ack.wrong_last_sequence
    assert ack.reason == "maximum messages exceeded (err_code 10054)"


@pytest.mark.parametrize("answer", [b"", b"not json", b'{"seq":"seven"}', b"[1,2]"])
def test_an_answer_that_is_no_pub_ack_is_a_typed_error(answer: bytes) -> None:
    with pytest.raises(LogError, match="lease s9: an answer that is not a PubAck"):
        read_pub_ack(answer, "lease s9")
