"""The envelope codec: round trips, typed errors for bad bytes, and reading old logs via upcasters."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from tests.strategies import (
    GeneratedSession,
    born,
    example_events,
    session_started,
    valid_sessions,
)

from apomesh.core import envelope
from apomesh.core.errors import CodecError, MalformedEnvelope, UnknownEventKind
from apomesh.core.events import EVENT_TYPES, AgentSnapshotted, ToolCallRecorded
from apomesh.core.state import fold

TS = 1_700_000_123.5


def raw(*items: Any) -> bytes:
    """Bytes of an envelope written by hand, as an older (or broken) writer would have."""
    return msgspec.msgpack.encode(list(items))


def test_examples_cover_every_event_type() -> None:
    assert {type(e) for e in example_events()} == set(EVENT_TYPES)


@pytest.mark.parametrize("event", example_events(), ids=lambda e: type(e).__name__)
def test_every_event_type_round_trips(event: Any) -> None:
    env = envelope.make("s-1", 12, TS, "s-1:12", event)
    back = envelope.decode(envelope.encode(env))
    assert back == env
    assert type(back.event) is type(event)
    assert back.v == envelope.SCHEMA_VERSION


def test_bytes_survive_as_bytes() -> None:
    (checkpoint,) = [e for e in example_events() if type(e).__name__ == "CoordinatorCheckpoint"]
    back = envelope.decode(envelope.encode(envelope.make("s", 0, TS, "e", checkpoint)))
    assert back.event.state == b"\x00\x01\xfe\xff"  # type: ignore[union-attr]


@settings(max_examples=50)
@given(valid_sessions())
def test_generated_logs_round_trip(session: GeneratedSession) -> None:
    envs = session.envelopes
    assert [envelope.decode(envelope.encode(e)) for e in envs] == envs


def test_the_envelope_is_a_six_item_array() -> None:
    env = envelope.make("s-1", 3, TS, "id-3", AgentSnapshotted("root", 1, "node", 2))
    decoded = msgspec.msgpack.decode(envelope.encode(env))
    assert decoded[:5] == [envelope.SCHEMA_VERSION, "s-1", 3, TS, "id-3"]
    assert decoded[5]["kind"] == "AgentSnapshotted"


# --- unknown kinds and malformed bytes ----------------------------------------------------------


def test_unknown_kind_names_session_and_index() -> None:
    data = raw(envelope.SCHEMA_VERSION, "s-9", 41, TS, "e", {"kind": "SessionExploded", "x": 1})
    with pytest.raises(UnknownEventKind) as info:
        envelope.decode(data, session_id="s-9", index=41)
    assert (info.value.session_id, info.value.index) == ("s-9", 41)
    assert "s-9" in str(info.value) and "41" in str(info.value)
    assert "SessionExploded" in str(info.value)


def test_unknown_kind_is_named_from_the_record_when_the_caller_does_not_know() -> None:
    data = raw(envelope.SCHEMA_VERSION, "s-9", 41, TS, "e", {"kind": "Nope"})
    with pytest.raises(UnknownEventKind) as info:
        envelope.decode(data)
    assert (info.value.session_id, info.value.index) == ("s-9", 41)


def _good_bytes() -> bytes:
    return envelope.encode(envelope.make("s-2", 5, TS, "e", AgentSnapshotted("root", 1, "node", 2)))


MALFORMED: dict[str, bytes] = {
    "truncated": _good_bytes()[:-7],
    "truncated to one byte": _good_bytes()[:1],
    "empty": b"",
    "not msgpack": b"\xc1\xc1\xc1",
    "json text": b'{"kind": "SessionEnded"}',
    "trailing garbage": _good_bytes() + b"\x00",
    "five items": raw(1, "s-2", 5, TS, "e"),
    "a map": msgspec.msgpack.encode({"v": 1, "session_id": "s-2", "index": 5}),
    "a bare event": msgspec.msgpack.encode({"kind": "AgentResumed", "agent": "root"}),
    "version is text": raw("1", "s-2", 5, TS, "e", {"kind": "AgentResumed", "agent": "root"}),
    "version from the future": raw(
        envelope.SCHEMA_VERSION + 1, "s-2", 5, TS, "e", {"kind": "AgentResumed", "agent": "r"}
    ),
    "version zero": raw(0, "s-2", 5, TS, "e", {"kind": "AgentResumed", "agent": "root"}),
    "index is text": raw(1, "s-2", "5", TS, "e", {"kind": "AgentResumed", "agent": "root"}),
    "ts is text": raw(1, "s-2", 5, "noon", "e", {"kind": "AgentResumed", "agent": "root"}),
    "event is a number": raw(1, "s-2", 5, TS, "e", 17),
    "event has no kind": raw(1, "s-2", 5, TS, "e", {"agent": "root"}),
    "kind is a number": raw(1, "s-2", 5, TS, "e", {"kind": 3}),
    "missing field": raw(1, "s-2", 5, TS, "e", {"kind": "AgentResumed"}),
    "field of the wrong type": raw(1, "s-2", 5, TS, "e", {"kind": "AgentResumed", "agent": 7}),
    "literal out of range": raw(
        1, "s-2", 5, TS, "e", {"kind": "AgentLifecycle", "agent": "root", "phase": "dancing"}
    ),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_bytes_raise_malformed_envelope_naming_session_and_index(data: bytes) -> None:
    with pytest.raises(MalformedEnvelope) as info:
        envelope.decode(data, session_id="s-2", index=5)
    assert (info.value.session_id, info.value.index) == ("s-2", 5)
    assert str(info.value).startswith("session s-2 index 5: ")
    assert not info.value.retryable


def test_codec_errors_share_a_base() -> None:
    assert issubclass(MalformedEnvelope, CodecError) and issubclass(UnknownEventKind, CodecError)


def test_a_field_a_newer_build_added_is_ignored() -> None:
    data = raw(1, "s", 0, TS, "e", {"kind": "AgentResumed", "agent": "root", "colour": "red"})
    assert (
        envelope.decode(data).event
        == envelope.decode(raw(1, "s", 0, TS, "e", {"kind": "AgentResumed", "agent": "root"})).event
    )


def test_an_old_record_without_a_defaulted_field_reads_with_the_default() -> None:
    event = {"kind": "AgentSnapshotted", "agent": "root", "snapshot_id": 1, "source": "node"}
    data = raw(envelope.SCHEMA_VERSION, "s", 0, TS, "e", {**event, "step": 2})
    assert envelope.decode(data).event == AgentSnapshotted("root", 1, "node", 2, size=0)


# --- upcasters: an old log stays readable after an event changes -------------------------------
#
# The scenario: at schema version 1 a journaled result said ``ok: bool``; version 2 replaces it
# with the required ``outcome`` field that ``ToolCallRecorded`` has today. The test moves the
# build to version 2 and proves a log written at version 1 still decodes and folds, through an
# upcaster, while version-2 records take the fast path untouched.


def _ok_to_outcome(mapping: dict[str, Any]) -> dict[str, Any]:
    event = dict(mapping["event"])
    if event["kind"] == "ToolCallRecorded":
        event["outcome"] = "ok" if event.pop("ok") else "error"
    return {**mapping, "event": event}


@pytest.fixture
def schema_v2(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pretend this build writes schema version 2; returns the versions the upcaster saw."""
    seen: list[int] = []

    def upcaster(mapping: dict[str, Any]) -> dict[str, Any]:
        seen.append(mapping["v"])
        return _ok_to_outcome(mapping)

    monkeypatch.setattr(envelope, "SCHEMA_VERSION", 2)
    monkeypatch.setattr(envelope, "_UPCASTERS", {})
    envelope.register_upcaster(1, upcaster)
    return seen


def _v1_log() -> list[bytes]:
    """A version-1 log as the old build wrote it (its events are the old shapes)."""
    started = msgspec.to_builtins(session_started())
    root = msgspec.to_builtins(born("root"))
    intent = {
        "kind": "ToolCallIntent",
        "agent": "root",
        "key": "k1",
        "tool": "fs.append",
        "args": {"path": "a.txt", "line": "x"},
    }
    recorded = {"kind": "ToolCallRecorded", "agent": "root", "key": "k1", "tool": "fs.append"}
    return [
        raw(1, "old", 0, TS, "old:0", started),
        raw(1, "old", 1, TS + 1, "old:1", root),
        raw(1, "old", 2, TS + 2, "old:2", intent),
        raw(1, "old", 3, TS + 3, "old:3", {**recorded, "ok": True, "result": "appended"}),
    ]


def test_an_old_record_is_upcast_to_the_current_shape(schema_v2: list[int]) -> None:
    old = {"kind": "ToolCallRecorded", "agent": "root", "key": "k", "tool": "fs.append"}
    data = raw(1, "old", 3, TS, "e", {**old, "ok": False, "result": "disk full"})
    env = envelope.decode(data)
    assert env.v == 2
    assert env.event == ToolCallRecorded("root", "k", "fs.append", "error", "disk full")
    assert schema_v2 == [1]


def test_an_old_log_folds_through_the_upcaster(schema_v2: list[int]) -> None:
    state = fold(envelope.decode(b, index=i) for i, b in enumerate(_v1_log()))
    entry = state.journal[("root", "k1")]
    assert (entry.outcome, entry.result) == ("ok", "appended")
    assert state.unknown_outcomes == [] and state.side_effects == 1
    # Records whose shape did not change are still lifted one version, exactly once each.
    assert schema_v2 == [1, 1, 1, 1]


def test_current_records_skip_the_upcaster(schema_v2: list[int]) -> None:
    env = envelope.make("new", 0, TS, "e", ToolCallRecorded("root", "k", "t", "unknown", ""))
    assert env.v == 2
    assert envelope.decode(envelope.encode(env)) == env
    assert schema_v2 == []


def test_an_old_log_with_no_upcaster_is_refused_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envelope, "SCHEMA_VERSION", 2)
    monkeypatch.setattr(envelope, "_UPCASTERS", {})
    with pytest.raises(MalformedEnvelope, match="no upcaster from schema version 1") as info:
        envelope.decode(_v1_log()[3], session_id="old", index=3)
    assert (info.value.session_id, info.value.index) == ("old", 3)


def test_an_upcast_record_that_is_still_wrong_is_malformed(schema_v2: list[int]) -> None:
    data = raw(1, "old", 3, TS, "e", {"kind": "ToolCallRecorded", "agent": "root", "ok": True})
    with pytest.raises(MalformedEnvelope) as info:
        envelope.decode(data)
    assert (info.value.session_id, info.value.index) == ("old", 3)


def test_the_v1_log_is_unreadable_without_the_schema_change() -> None:
    # Guards the scenario itself: at version 1 the old ``ok`` record does not fit today's type.
    with pytest.raises(MalformedEnvelope):
        envelope.decode(_v1_log()[3])
