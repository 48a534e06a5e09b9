"""The boot scan's pass over pages of the log (``stream_fold._fold_page``) with fold checkpoints:
a session current in its checkpoint is passed over (its state the checkpoint's), unless the pass
meets an envelope of it past the checkpoint (appended after the log was counted: ``suspect``); a
session folded on from a checkpoint counts its messages on from the checkpoint's count, and one
folded from its start counts them all. Pure: pages built in memory, no server."""

from __future__ import annotations

import uuid

from tests.e2e.chaos_kit import shape_of, stored_session, thinker

from apomesh.adapters.log_messages import pack
from apomesh.adapters.memory_log import OutgoingEvent
from apomesh.adapters.nats_connect import DirectGetPage
from apomesh.adapters.stream_fold import ResumePoint, StreamFold, _finish, _fold_page
from apomesh.core import envelope
from apomesh.core.envelope import Envelope
from apomesh.core.state import fold

STEP = 2
"""Envelopes a message holds (as a step's appends)."""


def messages(envelopes: list[Envelope]) -> list[bytes]:
    session_id = envelopes[0].session_id
    out = []
    for first in range(0, len(envelopes), STEP):
        run = [
            OutgoingEvent(e.index, envelope.encode(e), e.event_id)
            for e in envelopes[first : first + STEP]
        ]
        (packed,) = pack(session_id, run, 1 << 20)
        out.append(packed.payload)
    return out


def point(envelopes: list[Envelope], messages_held: int, counted: bool = True) -> ResumePoint:
    """The checkpoint a writer leaves after ``messages_held`` messages of the session."""
    at = messages_held * STEP - 1
    return ResumePoint(
        fold(envelopes[: at + 1]),
        envelopes[at].event_id,
        seq=messages_held,
        messages=messages_held if counted else None,
        log_id="L",
    )


def run_pass(
    payloads: list[bytes],
    waiting: dict[str, ResumePoint],
    current: dict[str, ResumePoint],
) -> StreamFold:
    result = StreamFold()
    page = DirectGetPage([], 0, len(payloads), payloads)
    assert _fold_page(result, page, None, set(), waiting, current, 0, len(payloads))
    _finish(result, current)
    return result


def session() -> list[Envelope]:
    return stored_session(uuid.uuid4().hex, shape_of(thinker(2)), events=12)


def test_a_current_session_is_passed_over_and_taken_from_its_checkpoint() -> None:
    quiet, busy = session(), session()
    current = {quiet[0].session_id: point(quiet, 6)}  # all its 6 messages counted
    result = run_pass(messages(quiet) + messages(busy), {}, current)
    assert result.current == {quiet[0].session_id}
    assert result.states[quiet[0].session_id] is current[quiet[0].session_id].state
    assert result.counts == {quiet[0].session_id: 6, busy[0].session_id: 6}
    assert result.folded == len(busy)  # none of the current session's envelopes


def test_a_current_session_the_pass_finds_appended_to_is_suspect() -> None:
    appended = session()
    current = {appended[0].session_id: point(appended, 5)}  # its sixth message came later
    result = run_pass(messages(appended), {}, current)
    assert appended[0].session_id in result.suspect
    assert not result.current and appended[0].session_id not in result.states


def test_a_session_folded_on_from_a_checkpoint_counts_on_from_its_count() -> None:
    counted, uncounted = session(), session()
    waiting = {
        counted[0].session_id: point(counted, 4),
        uncounted[0].session_id: point(uncounted, 4, False),
    }
    result = run_pass(messages(counted) + messages(uncounted), waiting, {})
    assert result.resumed == {counted[0].session_id, uncounted[0].session_id}
    assert result.states[counted[0].session_id] == fold(counted)
    assert result.counts == {counted[0].session_id: 6}  # 4 in the checkpoint, 2 after it
    assert result.uncounted == {uncounted[0].session_id}
