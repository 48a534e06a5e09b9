"""How a session's envelopes are laid out in the log stream's messages.

An append's envelopes go as one message where they fit: a *run*, the msgpack array
``[0, session_id, first_index, [envelope, ...]]`` whose last element holds the envelopes' own
bytes, unchanged. An envelope starts with its schema version (1 or more), a run with ``0``, so
the two cannot be mistaken for each other. Logs written before runs hold one bare envelope per
message; every reader takes both (``entries``, ``envelopes``). An append too large for one message
is cut into several runs (``pack``), each under the stream's message size limit.

A run's ``Nats-Msg-Id`` is ``<session_id>:<first>``, as a bare envelope's was
``<session_id>:<index>``: a resend of the same run carries the same id, which the server's
duplicate window answers as a duplicate, and a deleted session's id reused within the window is
refused at its first message whatever the new append's shape. Which indexes a message holds is
read from its bytes (``index_range``).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from apomesh.adapters.memory_log import OutgoingEvent
from apomesh.core import envelope
from apomesh.core.envelope import Envelope, decode

RUN_MARKER = 0
"""The first element of a run; an envelope's is its schema version, never 0."""
RUN_OVERHEAD = 64
"""Bytes a run adds around its envelopes, beyond the session id (array headers, the marker and
the first index), rounded up."""


class Run(msgspec.Struct, frozen=True):
    """One message on its way to the log: the envelopes from ``first`` to ``last``."""

    first: int
    last: int
    payload: bytes

    def msg_id(self, session_id: str) -> str:
        return f"{session_id}:{self.first}"


class _Head(msgspec.Struct, array_like=True):
    """The first three elements of either form: marker or version, session, index."""

    v: int
    session_id: str
    index: int


class _RawRun(msgspec.Struct, array_like=True):
    v: int
    session_id: str
    first: int
    envelopes: list[msgspec.Raw]


class _TypedRun(msgspec.Struct, array_like=True):
    v: int
    session_id: str
    first: int
    envelopes: list[Envelope]


_head_decode = msgspec.msgpack.Decoder(_Head).decode
_raw_run_decode = msgspec.msgpack.Decoder(_RawRun).decode
_typed_run_decode = msgspec.msgpack.Decoder(_TypedRun).decode
_encode = msgspec.msgpack.Encoder().encode


def pack(session_id: str, pending: Sequence[OutgoingEvent], max_bytes: int) -> list[Run]:
    """``pending`` (consecutive envelopes) as runs of at most ``max_bytes`` each, plus the run's
    overhead; an envelope is never split, so one at the limit travels alone."""
    budget = max_bytes - len(session_id.encode()) - RUN_OVERHEAD
    runs: list[Run] = []
    chunk: list[OutgoingEvent] = []
    size = 0
    for outgoing in pending:
        if chunk and size + len(outgoing.payload) > budget:
            runs.append(_run(session_id, chunk))
            chunk, size = [], 0
        chunk.append(outgoing)
        size += len(outgoing.payload)
    if chunk:
        runs.append(_run(session_id, chunk))
    return runs


def _run(session_id: str, chunk: list[OutgoingEvent]) -> Run:
    payload = _encode(
        [RUN_MARKER, session_id, chunk[0].index, [msgspec.Raw(o.payload) for o in chunk]]
    )
    return Run(chunk[0].index, chunk[-1].index, payload)


def _head(data: bytes) -> _Head | None:
    try:
        return _head_decode(data)
    except msgspec.MsgspecError:
        return None


def entries(data: bytes) -> tuple[int | None, list[bytes]]:
    """A message's envelopes as bytes, with the index of the first: a run's, or, for a bare
    envelope, its own (None when the bytes are neither: the caller's decode then raises the
    codec's typed error for them)."""
    head = _head(data)
    if head is None:
        return None, [data]
    if head.v != RUN_MARKER:
        return head.index, [data]
    try:
        run = _raw_run_decode(data)
    except msgspec.MsgspecError:
        return None, [data]
    return run.first, [bytes(raw) for raw in run.envelopes]


def index_range(data: bytes) -> tuple[int, int] | None:
    """The first and last index a message holds; None when it is neither form."""
    head = _head(data)
    if head is None:
        return None
    if head.v != RUN_MARKER:
        return head.index, head.index
    try:
        run = _raw_run_decode(data)
    except msgspec.MsgspecError:
        return None
    return run.first, run.first + len(run.envelopes) - 1


def envelopes(data: bytes) -> list[Envelope]:
    """A message's envelopes decoded, a run's in one call (``CodecError`` for what is neither)."""
    if data[:2] == b"\x94\x00":  # a run: a 4-item array starting with the marker
        try:
            decoded = _typed_run_decode(data).envelopes
        except msgspec.MsgspecError:
            decoded = None
        if decoded is not None:
            for env in decoded:  # a loop, not all(...): no generator for each of a million runs
                if env.v != envelope.SCHEMA_VERSION:
                    break
            else:
                return decoded
        # An envelope of an older schema inside (upcast one by one), or not a run after all.
        first, payloads = entries(data)
        if first is None:
            return [decode(data)]
        return [decode(payload) for payload in payloads]
    return [decode(data)]
