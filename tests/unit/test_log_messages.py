"""How the log lays envelopes out in messages (``adapters.log_messages``): an append as one run,
cut only past the size limit; both forms read back, and an older schema inside a run upcast."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest
from tests.strategies import born, session_started
from tests.unit.test_envelope import _v1_log, raw, schema_v2  # noqa: F401 - a fixture

from apomesh.adapters.log_messages import entries, envelopes, index_range, pack
from apomesh.adapters.memory_log import OutgoingEvent, prepare_batch
from apomesh.core import envelope
from apomesh.core.errors import CodecError

SID = "s-runs"
TS = 1_700_000_000.0


def outgoing(count: int, start: int = 0) -> list[OutgoingEvent]:
    events = [session_started(), *(born(f"a{n}") for n in range(count - 1))]
    made = [
        envelope.make(SID, start + i, TS + i, f"e{start + i}", ev) for i, ev in enumerate(events)
    ]
    return prepare_batch(SID, made)


def test_an_append_is_one_run_that_reads_back_envelope_by_envelope() -> None:
    pending = outgoing(4, start=10)
    (run,) = pack(SID, pending, 1 << 20)
    assert (run.first, run.last, run.msg_id(SID)) == (10, 13, f"{SID}:10")
    assert entries(run.payload) == (10, [o.payload for o in pending])
    assert index_range(run.payload) == (10, 13)
    assert [e.index for e in envelopes(run.payload)] == [10, 11, 12, 13]
    assert envelopes(run.payload) == [envelope.decode(o.payload) for o in pending]


def test_past_the_size_limit_an_append_is_cut_between_envelopes_never_inside_one() -> None:
    pending = outgoing(6)
    limit = len(pending[0].payload) + len(pending[1].payload) + len(SID) + 64
    runs = pack(SID, pending, limit)
    assert runs[0].first == 0 and runs[-1].last == 5 and len(runs) > 1
    assert all(b.first == a.last + 1 for a, b in itertools.pairwise(runs))
    assert all(len(r.payload) <= limit for r in runs)
    alone = pack(SID, pending, 1)  # each envelope travels alone, whatever the limit
    assert [(r.first, r.last) for r in alone] == [(i, i) for i in range(6)]
    assert [e for r in runs for e in envelopes(r.payload)] == [
        envelope.decode(o.payload) for o in pending
    ]


def test_a_bare_envelope_of_an_earlier_release_reads_as_a_message_of_one() -> None:
    (bare,) = outgoing(1, start=7)
    assert entries(bare.payload) == (7, [bare.payload])
    assert index_range(bare.payload) == (7, 7)
    assert envelopes(bare.payload) == [envelope.decode(bare.payload)]


def test_bytes_that_are_neither_form_raise_the_codecs_typed_error() -> None:
    for junk in (b"\x93\x01garbage", b"not msgpack"):
        assert index_range(junk) is None and entries(junk) == (None, [junk])
        with pytest.raises(CodecError):
            envelopes(junk)
    with pytest.raises(CodecError):  # a run whose items are not envelopes
        envelopes(msgspec.msgpack.encode([0, SID, 0, [1, 2]]))


def test_an_older_schema_inside_a_run_is_upcast(schema_v2: list[int]) -> None:  # noqa: F811
    old: list[Any] = _v1_log()
    run = msgspec.msgpack.encode([0, "old", 0, [msgspec.Raw(data) for data in old]])
    decoded = envelopes(run)
    assert [e.v for e in decoded] == [2, 2, 2, 2]
    assert [e.index for e in decoded] == [0, 1, 2, 3]
    assert decoded == [envelope.decode(data) for data in old]
    assert raw  # the helper the upcast log is written with
