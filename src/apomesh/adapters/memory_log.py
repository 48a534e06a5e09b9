"""An in-memory ``EventLog`` with the JetStream log's exact semantics, and the rules they share.

The rules live here, free of NATS, so both logs apply them alike: a step's envelopes must belong to
the session and carry consecutive indexes (``prepare_batch``); an append that does not continue
the log is settled against what is stored (``settle_overlap``): envelopes already stored with the
same event id count as written (a retry never duplicates), anything else stored at those indexes
is another writer's (``AppendConflict``), and a start past the end is a gap (``AppendConflict``).
``MemoryLog`` stores encoded bytes and decodes on read, so a corrupt entry fails the same way it
does on the real log; ``append_raw`` plants such an entry for tests.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence

import anyio
import msgspec

from apomesh.core.envelope import Envelope, decode, encode
from apomesh.core.errors import (
    AppendConflict,
    CodecError,
    DuplicateIndex,
    IndexGap,
    MalformedEnvelope,
    PayloadTooLarge,
)
from apomesh.core.ports import EventLog

DEFAULT_MAX_EVENT_BYTES = 1024 * 1024


class OutgoingEvent(msgspec.Struct, frozen=True):
    """One envelope on its way to the log: its index, encoded bytes and event id."""

    index: int
    payload: bytes
    event_id: str


_SESSION_ID = re.compile(r"[^.*>\s]+")


def check_session_id(session_id: str) -> None:
    """A session id is one NATS subject token: non-empty, printable, without ``.``, ``*``, ``>``."""
    if _SESSION_ID.fullmatch(session_id) is None or not session_id.isprintable():
        raise ValueError(
            f"invalid session id {session_id!r}: one token, no '.', '*', '>' or spaces"
        )


def prepare_batch(
    session_id: str,
    envelopes: Sequence[Envelope],
    *,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
) -> list[OutgoingEvent]:
    """Encode a step's envelopes after checking they belong to ``session_id`` and follow each other.

    A batch that breaks those rules is a caller bug (``ValueError``); an event over the size limit
    is ``PayloadTooLarge``.
    """
    check_session_id(session_id)
    batch: list[OutgoingEvent] = []
    for position, envelope in enumerate(envelopes):
        if envelope.session_id != session_id:
            raise ValueError(
                f"envelope {envelope.index} belongs to session {envelope.session_id!r}, not {session_id!r}"
            )
        if position and envelope.index != envelopes[0].index + position:
            raise ValueError(
                f"envelope indexes in one append must be consecutive, got {envelope.index}"
            )
        if envelope.index < 0:
            raise ValueError(f"negative envelope index {envelope.index}")
        payload = encode(envelope)
        if len(payload) > max_event_bytes:
            raise PayloadTooLarge(
                f"event {envelope.index} of session {session_id}", len(payload), max_event_bytes
            )
        batch.append(OutgoingEvent(envelope.index, payload, envelope.event_id))
    return batch


def is_same_event(stored: bytes, outgoing: OutgoingEvent, session_id: str) -> bool:
    """Whether the stored bytes are this very event: the same bytes, or the same index and id."""
    if stored == outgoing.payload:
        return True
    try:
        envelope = decode(stored, session_id=session_id, index=outgoing.index)
    except CodecError:
        return False
    return envelope.index == outgoing.index and envelope.event_id == outgoing.event_id


def settle_overlap(
    session_id: str, pending: Sequence[OutgoingEvent], stored: Sequence[tuple[int, bytes]]
) -> list[OutgoingEvent]:
    """Given the stored entries from ``pending[0].index`` on, return what is still to be written.

    Raises ``AppendConflict`` when a stored entry at one of our indexes is not ours.
    """
    for outgoing, (index, data) in zip(pending, stored, strict=False):
        if index != outgoing.index or not is_same_event(data, outgoing, session_id):
            raise AppendConflict(
                f"session {session_id} index {outgoing.index} holds another writer's event"
            )
    return list(pending[len(stored) :])


def gap_conflict(session_id: str, first_index: int, last_index: int) -> AppendConflict:
    return AppendConflict(
        f"session {session_id}: append at index {first_index} does not continue the log,"
        f" whose last index is {last_index}"
    )


def check_dense(session_id: str, expected: int, index: int) -> None:
    """Raise the fold's typed error when a stored index is not the next one."""
    if index > expected:
        raise IndexGap(
            f"expected index {expected}, found {index}", session_id=session_id, index=expected
        )
    if index < expected:
        raise DuplicateIndex(
            f"expected index {expected}, found {index}", session_id=session_id, index=index
        )


def decode_entry(session_id: str, index: int, data: bytes) -> Envelope:
    """Decode one stored entry and check that it is what its place in the log says."""
    envelope = decode(data, session_id=session_id, index=index)
    if envelope.session_id != session_id:
        raise MalformedEnvelope(
            f"the envelope names session {envelope.session_id!r}",
            session_id=session_id,
            index=index,
        )
    check_dense(session_id, index, envelope.index)
    return envelope


class MemoryLog:
    """``EventLog`` on a dict of per-session byte lists; nothing survives the process."""

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._entries: dict[str, list[bytes]] = {}
        self._changed: dict[str, anyio.Event] = {}
        self._max_event_bytes = max_event_bytes

    async def ensure(self) -> None:
        return None

    async def append(self, session_id: str, envelopes: Sequence[Envelope]) -> None:
        pending = prepare_batch(session_id, envelopes, max_event_bytes=self._max_event_bytes)
        if not pending:
            return
        entries = self._entries.setdefault(session_id, [])
        first = pending[0].index
        if first > len(entries):
            raise gap_conflict(session_id, first, len(entries) - 1)
        stored = [
            (index, entries[index])
            for index in range(first, min(len(entries), first + len(pending)))
        ]
        entries.extend(outgoing.payload for outgoing in settle_overlap(session_id, pending, stored))
        self._notify(session_id)

    def append_raw(self, session_id: str, data: bytes) -> None:
        """Store arbitrary bytes as the session's next entry (tests of corrupt logs)."""
        check_session_id(session_id)
        self._entries.setdefault(session_id, []).append(data)
        self._notify(session_id)

    def _notify(self, session_id: str) -> None:
        event = self._changed.pop(session_id, None)
        if event is not None:
            event.set()

    async def read_raw(self, session_id: str, after: int = -1) -> list[tuple[int, bytes]]:
        entries = self._entries.get(session_id, [])
        start = max(after + 1, 0)
        return [(index, entries[index]) for index in range(start, len(entries))]

    async def read(self, session_id: str, after: int = -1) -> list[Envelope]:
        return [
            decode_entry(session_id, index, data)
            for index, data in await self.read_raw(session_id, after)
        ]

    async def last_index(self, session_id: str) -> int:
        entries = self._entries.get(session_id, [])
        if not entries:
            return -1
        return decode_entry(session_id, len(entries) - 1, entries[-1]).index

    async def tail(self, session_id: str, after: int = -1) -> AsyncIterator[Envelope]:
        next_index = max(after + 1, 0)
        while True:
            entries = self._entries.get(session_id, [])
            if next_index < len(entries):
                yield decode_entry(session_id, next_index, entries[next_index])
                next_index += 1
                continue
            changed = self._changed.setdefault(session_id, anyio.Event())
            await changed.wait()

    async def list_sessions(self) -> list[str]:
        return [session_id for session_id, entries in self._entries.items() if entries]

    async def delete_session(self, session_id: str) -> None:
        self._entries.pop(session_id, None)


def _is_an_event_log(log: MemoryLog) -> EventLog:
    """Never called: lets the type checker prove ``MemoryLog`` satisfies the ``EventLog`` port."""
    return log
