"""The envelope every event travels in, and the one shared msgpack codec.

An envelope carries the schema version, the session id, the event's index in its session (0-based,
dense), a timestamp and an event id, all given by the caller (the core reads no clock). ``decode``
raises ``MalformedEnvelope`` or ``UnknownEventKind`` naming the session and index. Logs written by
an older schema are read through upcasters: functions registered per source version that rewrite
the raw mapping one version forward before it is typed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from apomesh.core.errors import MalformedEnvelope, UnknownEventKind
from apomesh.core.events import EVENT_NAMES, Event

SCHEMA_VERSION = 1


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """One log entry: ``v`` schema version, session, dense index, time (unix s), id, event."""

    v: int
    session_id: str
    index: int
    ts: float
    event_id: str
    event: Event


Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
_UPCASTERS: dict[int, Upcaster] = {}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)
_raw_decoder = msgspec.msgpack.Decoder()


def register_upcaster(from_version: int, upcaster: Upcaster) -> None:
    """Register how to lift an envelope of ``from_version`` to ``from_version + 1``.

    The upcaster receives the raw envelope as a mapping with keys ``v``, ``session_id``,
    ``index``, ``ts``, ``event_id`` and ``event`` (itself a mapping with ``kind``) and returns it
    rewritten; it need not touch ``v``.
    """
    _UPCASTERS[from_version] = upcaster


def encode(envelope: Envelope) -> bytes:
    return _encoder.encode(envelope)


def encode_event(event: Event) -> bytes:
    """Bytes of one bare event (used for size checks and digests)."""
    return _encoder.encode(event)


def make(session_id: str, index: int, ts: float, event_id: str, event: Event) -> Envelope:
    return Envelope(SCHEMA_VERSION, session_id, index, ts, event_id, event)


def decode(data: bytes, *, session_id: str | None = None, index: int | None = None) -> Envelope:
    """Decode one envelope; ``session_id``/``index`` name the entry in errors when known."""
    try:
        env = _decoder.decode(data)
    except msgspec.ValidationError:
        return _decode_slow(data, session_id, index)
    except msgspec.DecodeError as exc:
        raise MalformedEnvelope(
            f"not a msgpack envelope ({exc})", session_id=session_id, index=index
        ) from None
    if env.v != SCHEMA_VERSION:
        return _decode_slow(data, session_id, index)
    return env


def _decode_slow(data: bytes, session_id: str | None, index: int | None) -> Envelope:
    try:
        raw = _raw_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise MalformedEnvelope(
            f"not a msgpack envelope ({exc})", session_id=session_id, index=index
        ) from None
    if not isinstance(raw, list) or len(raw) != 6:
        raise MalformedEnvelope("an envelope is a 6-item array", session_id=session_id, index=index)
    v, sid, idx, ts, event_id, event = raw
    session_id = sid if isinstance(sid, str) else session_id
    index = idx if isinstance(idx, int) else index
    if not isinstance(v, int) or v < 1 or v > SCHEMA_VERSION:
        raise MalformedEnvelope(
            f"unsupported schema version {v!r}", session_id=session_id, index=index
        )
    if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
        raise MalformedEnvelope("the event has no `kind`", session_id=session_id, index=index)
    mapping = {
        "v": v,
        "session_id": sid,
        "index": idx,
        "ts": ts,
        "event_id": event_id,
        "event": event,
    }
    while mapping["v"] < SCHEMA_VERSION:
        upcaster = _UPCASTERS.get(mapping["v"])
        if upcaster is None:
            raise MalformedEnvelope(
                f"no upcaster from schema version {mapping['v']}",
                session_id=session_id,
                index=index,
            )
        mapping = dict(upcaster(mapping))
        mapping["v"] = int(mapping["v"]) + 1
    kind = mapping["event"].get("kind")
    if kind not in EVENT_NAMES:
        raise UnknownEventKind(f"unknown event kind {kind!r}", session_id=session_id, index=index)
    try:
        return msgspec.convert(
            [
                mapping["v"],
                mapping["session_id"],
                mapping["index"],
                mapping["ts"],
                mapping["event_id"],
                mapping["event"],
            ],
            Envelope,
        )
    except msgspec.ValidationError as exc:
        raise MalformedEnvelope(
            f"bad envelope: {exc}", session_id=session_id, index=index
        ) from None
