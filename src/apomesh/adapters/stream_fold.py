"""The boot scan's fast path: fold every session on the JetStream log in one pass over the stream
(``JetStreamLog.fold_all``).

Reading sessions one by one costs a direct get each, and the server's cost for each grows with how
finely sessions are interleaved in the stream (it steps over every other session's events between
two of this one's): about 1 ms per session at 1,000 stored sessions, 2-3 ms at 10,000. One pass
in stream order reads every event exactly once instead, a page of up to ``page`` events per
request, without headers (nats-py parses headers slowly; the envelope names its own session and
index), and folds each envelope into its session's state as it arrives. A page is asked for by
sequence alone, with no subject filter: the log stream's only subjects are ``<prefix>.*``
(``JetStreamLog`` creates and reconciles it so), and a filter costs the server a match for each
message and a count of what is left for each page (about 12 % of its CPU in a pass over a
million messages). Of the messages a stream reconfigured from other subjects still holds, one
that is no envelope is passed over, one of a session not listed under the prefix folds into a
state the caller does not ask for, and one repeating a listed session's index makes that session
``suspect`` (below), read one by one from its own subject.

The pass only vouches for what it could check: a payload that does not decode (its session is
unknown without headers: the page is read again with them to name it), a session whose envelopes
do not fold (a gap, a duplicate, an envelope filed under another session's subject) and a session
listed on the stream but absent from the pass are ``suspect``; the caller reads those one by one
through the log adapter, which names the exact error. Sessions in ``skip`` (those with a
completed-session record) are passed over unread.

A session with a fold checkpoint (``resume``: its state at an index, that envelope's event id and
stream sequence) starts from it: its envelopes before that index are dropped unfolded, the one at
it must carry the recorded event id (else the checkpoint is stale, the log having been purged or
replaced: the session is ``suspect``, and read from its start one by one), and the ones after it
are folded onto the checkpoint's state. When every session the caller wants (``sessions``) has a
checkpoint whose sequence is known, the pass starts at the lowest of those sequences instead of
the stream's first, so a long session is read from its checkpoint on, not from its first event.
A session whose checkpoint's envelope the pass never meets is left out (read one by one). A
wanted session without a checkpoint (one started just before its daemon stopped, whose first
checkpoint was not written yet) is looked up: where its first message is, one direct get each,
when there are at most ``FIRST_LOOKUPS`` of them; the pass then starts at the lowest of those
and of the checkpoints' sequences. With more of them it starts at the stream's first message.

A checkpoint is current, and its session is not read at all, when it counted as many messages of
the session as the log's listing holds now (``counts``: the stream's message count per subject),
on the same stream (``log_id``, its creation time): a session's subject is only ever appended to
(or purged whole with the session), so nothing follows it. When every wanted session is current
there is no pass. The pass counts the messages of each session it folds (``counts`` in the
result: from the stream's start, or on from a checkpoint that counted them), so that a writer
resuming one can keep counting.

Where each session's log ends (its last index and that message's stream sequence, ``ends``) is
noted on the way: a page that holds every sequence from where it was asked to start to its last
has its k-th message at sequence start + k, headers or not. A stream with deleted messages (a
retention sweep's purges) has pages with gaps; the pass asks the server which sequences are
deleted (``deleted_details``, when there are at most ``MAX_DELETED_LISTED``), and a page's
messages are then at the sequences between its ends less the deleted ones, if those account for
every gap. The sessions whose last message was in a page it cannot place (a message deleted
during the pass, or too many deleted to list) are not in ``ends`` (the caller asks for those:
80,000 of them took 1.8 s). An end is only a belief either way: an append it misleads is refused
by the expected-sequence check.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import msgspec

from apomesh.adapters.log_messages import envelopes
from apomesh.adapters.nats_connect import (
    JS_API_PREFIX,
    DirectGetPage,
    api_request,
    direct_get_batch,
)
from apomesh.core.envelope import Envelope
from apomesh.core.errors import ApomeshError, CodecError, FoldError
from apomesh.core.events import SessionShape, SessionStarted
from apomesh.core.state import SessionState, apply, new_state

MAX_PAGE_BYTES = 16 * 1024 * 1024
MAX_DELETED_LISTED = 500_000
"""The most deleted messages a stream may have for the pass to ask which they are (a JSON list
of their sequences in the stream's info, held as a set for the pass: about 30 MB at this many);
past it, pages with gaps leave their sessions' ends to the caller."""
FIRST_LOOKUPS = 4_096
"""The most wanted sessions without a checkpoint whose first message the pass looks up (one
direct get each, some hundreds of microseconds) rather than start at the stream's first."""
LOOKUPS_TOGETHER = 64
"""How many of those lookups are in flight at once."""
FOLD_SLICE = 200
"""Messages of a page folded between two turns of the event loop."""


class ResumePoint(msgspec.Struct, frozen=True):
    """Where a session's fold may start (a fold checkpoint): its ``state`` at
    ``state.last_index``, valid only if the log's envelope there has ``event_id``; ``seq`` is that
    envelope's stream sequence, when known."""

    state: SessionState
    event_id: str
    seq: int | None
    messages: int | None = None
    """How many messages of the session the log held up to the one holding ``state.last_index``
    when the checkpoint was taken (None: not known)."""
    log_id: str | None = None
    """The log ``messages`` was counted on."""


class StreamFold(msgspec.Struct):
    """What one pass over the log stream folded."""

    states: dict[str, SessionState] = msgspec.field(default_factory=dict)
    suspect: set[str] = msgspec.field(default_factory=set)
    resumed: set[str] = msgspec.field(default_factory=set)
    """The sessions in ``states`` folded on from their checkpoint."""
    current: set[str] = msgspec.field(default_factory=set)
    """The sessions in ``states`` whose checkpoint the log's counts showed current (not read)."""
    stale: set[str] = msgspec.field(default_factory=set)
    """The sessions whose checkpoint the log contradicts (they are ``suspect`` too)."""
    events: int = 0
    folded: int = 0
    """How many envelopes were folded into a state (not dropped before a checkpoint)."""
    pages: int = 0
    shapes: dict[str, SessionShape] = msgspec.field(default_factory=dict)
    """One shape per definition digest, shared by the sessions whose pinned shape equals it."""
    ends: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)
    """Session -> (its last index, the stream sequence of the message holding it), where the
    pass could tell (see the module docstring)."""
    last_ids: dict[str, str] = msgspec.field(default_factory=dict)
    """Session -> the event id of the envelope at its end in ``ends`` (what a checkpoint of
    its state is checked by)."""
    counts: dict[str, int] = msgspec.field(default_factory=dict)
    """Session -> how many messages its subject holds, for the sessions in ``states`` whose
    every message was counted (read by the pass, or counted by their checkpoint)."""
    uncounted: set[str] = msgspec.field(default_factory=set)
    """Sessions folded on from a checkpoint that did not count its messages."""


async def fold_stream(
    nc: Any,
    stream: str,
    subject_prefix: str,
    *,
    skip: set[str],
    resume: Mapping[str, ResumePoint] | None = None,
    sessions: Collection[str] | None = None,
    counts: Mapping[str, int] | None = None,
    log_id: str | None = None,
    page: int = 10_000,
    timeout: float = 10.0,
    progress: Callable[[int, int], None] | None = None,
) -> StreamFold:
    """Fold every session of ``stream`` (subjects ``<subject_prefix>.<session_id>``) that is not in
    ``skip``, reading the stream once in order, each from its ``resume`` point if it has one. See
    the module docstring for ``suspect``, for where the pass starts and for the checkpoints
    ``counts`` (of the stream ``log_id``) shows current. ``progress`` is called
    after each page with the messages read so far and the stream sequences the pass spans (as
    many messages, less the deleted ones)."""
    result = StreamFold()
    info = await api_request(nc, f"{JS_API_PREFIX}.STREAM.INFO.{stream}", {}, timeout=timeout)
    state = info.get("state", {})
    seq, last_seq = int(state.get("first_seq") or 1), int(state.get("last_seq") or 0)
    waiting = {s: point for s, point in (resume or {}).items() if s not in skip}
    current = {} if counts is None or log_id is None else _current(waiting, counts, log_id)
    needed = _first_needed(waiting, sessions, skip | current.keys(), last_seq)
    if needed is not None:
        firsts = await _first_sequences(nc, stream, subject_prefix, needed[1], timeout)
        if firsts is not None:
            seq = max(seq, min([needed[0], *firsts]))
    spanned = max(0, last_seq - seq + 1)
    deleted = await _deleted_sequences(nc, stream, state, timeout) if spanned else frozenset()
    read = 0
    wildcard = f"{subject_prefix}.*"

    def read_page(start: int) -> asyncio.Task[DirectGetPage]:
        request = {"seq": start, "batch": page, "max_bytes": MAX_PAGE_BYTES, "no_hdr": True}
        return asyncio.ensure_future(direct_get_batch(nc, stream, request, timeout=timeout))

    # The collector is paused for the pass: it allocates one state per session and an envelope
    # per event, all kept, and would otherwise walk the growing heap over and over (a third of
    # the pass's time at 10,000 sessions). Reference counting still frees what is dropped.
    collecting = gc.isenabled()
    gc.disable()
    upcoming = read_page(seq) if seq <= last_seq else None
    try:
        while upcoming is not None:
            got = await upcoming
            upcoming = None
            if not got.payloads:
                break
            if got.pending > 0 and got.last_sequence:
                # The next page is asked for now and arrives while this one is folded.
                upcoming = read_page(got.last_sequence + 1)
            result.pages += 1
            read += len(got.payloads)
            decodable = True
            positions = _positions(got, seq, deleted)
            for first in range(0, len(got.payloads), FOLD_SLICE):
                if first:
                    # The read loop takes in the next page meanwhile: a page folded in one go
                    # left the socket full and the server waiting for most of it.
                    await asyncio.sleep(0)
                decodable &= _fold_page(
                    result, got, positions, skip, waiting, current, first, FOLD_SLICE
                )
            if not decodable:
                for session_id in await _undecodable_sessions(
                    nc, stream, wildcard, seq, len(got.payloads), subject_prefix, timeout
                ):
                    _suspect(result, session_id)
            seq = got.last_sequence + 1
            if progress is not None:
                progress(read, spanned)
    finally:
        if upcoming is not None:
            upcoming.cancel()
            with contextlib.suppress(BaseException):
                await upcoming
        if collecting:
            gc.enable()
    _finish(result, current)
    return result


def _current(
    waiting: dict[str, ResumePoint], counts: Mapping[str, int], log_id: str
) -> dict[str, ResumePoint]:
    """Take out of ``waiting`` the checkpoints ``counts`` shows current: the pass reads none of
    their sessions' envelopes (``_fold_first``)."""
    current = {}
    for session_id, point in waiting.items():
        if (
            point.messages is not None
            and point.log_id == log_id
            and point.seq is not None
            and counts.get(session_id) == point.messages
        ):
            current[session_id] = point
    for session_id in current:
        del waiting[session_id]
    return current


def _finish(result: StreamFold, current: Mapping[str, ResumePoint]) -> None:
    """After the pass: drop the counts begun on from a checkpoint that did not count, and put
    the current checkpoints' states, ends and counts in ``result`` (of the sessions the pass
    found no later envelope of)."""
    for session_id in result.uncounted:
        result.counts.pop(session_id, None)
    for session_id, point in current.items():
        if session_id in result.suspect:
            continue
        assert point.seq is not None and point.messages is not None
        result.current.add(session_id)
        result.states[session_id] = point.state
        result.ends[session_id] = (point.state.last_index, point.seq)
        result.last_ids[session_id] = point.event_id
        result.counts[session_id] = point.messages


def _first_needed(
    waiting: Mapping[str, ResumePoint],
    sessions: Collection[str] | None,
    skip: set[str],
    last_seq: int,
) -> tuple[int, list[str]] | None:
    """The lowest stream sequence the pass must start at for the wanted sessions that start
    from a checkpoint of known sequence (past ``last_seq`` when none is left to read), and the
    wanted sessions without one (to be read from their first message); None when the caller
    named no sessions or more than ``FIRST_LOOKUPS`` have no checkpoint."""
    if sessions is None:
        return None
    seqs = []
    missing: list[str] = []
    for session_id in sessions:
        if session_id in skip:
            continue
        point = waiting.get(session_id)
        if point is None or point.seq is None:
            missing.append(session_id)
            if len(missing) > FIRST_LOOKUPS:
                return None
            continue
        seqs.append(point.seq)
    return (min(seqs) if seqs else last_seq + 1), missing


async def _first_sequences(
    nc: Any, stream: str, prefix: str, session_ids: Sequence[str], timeout: float
) -> list[int] | None:
    """The stream sequence of each session's first message (one direct get each,
    ``LOOKUPS_TOGETHER`` at a time); None when one cannot be told (the pass then starts at the
    stream's first message)."""
    gate = asyncio.Semaphore(LOOKUPS_TOGETHER)

    async def first(session_id: str) -> int | None:
        request = {"seq": 1, "next_by_subj": f"{prefix}.{session_id}", "batch": 1}
        async with gate:
            page = await direct_get_batch(nc, stream, request, timeout=timeout)
        if not page.messages:
            return None
        sequence = (page.messages[0].headers or {}).get("Nats-Sequence")
        return None if sequence is None else int(sequence)

    try:
        found = await asyncio.gather(*(first(s) for s in session_ids))
    except ApomeshError:
        return None
    if any(seq is None for seq in found):
        return None
    return [seq for seq in found if seq is not None]


def _fold_page(
    result: StreamFold,
    got: DirectGetPage,
    positions: Sequence[int] | None,
    skip: set[str],
    waiting: dict[str, ResumePoint],
    current: Mapping[str, ResumePoint],
    first: int,
    count: int,
) -> bool:
    """Fold ``count`` messages from the ``first`` of one page of envelopes (its ``payloads``: the
    pass asks for pages without headers) into their sessions' states (a session in ``waiting``
    from its checkpoint, once the envelope at its index is seen to be the checkpoint's), noting
    where each session ends when the page's ``positions`` (each message's stream sequence) are
    known; False when a payload among them is not an envelope (its session is then named by
    ``_undecodable_sessions``)."""
    decodable = True
    ends = result.ends
    last_ids = result.last_ids
    counts = result.counts
    states = result.states
    folded = 0
    for offset, data in enumerate(got.payloads[first : first + count], first):
        try:
            held = envelopes(data)
        except CodecError:
            decodable = False
            continue
        if not held:
            continue
        result.events += len(held)
        for env in held:
            # The common case first: an event of a session the pass folds already (a session
            # in ``skip`` or found ``suspect`` has no state here).
            state = states.get(env.session_id)
            if state is None or type(env.event) is SessionStarted:
                folded += _fold_first(result, env, skip, waiting, current)
                continue
            try:
                apply(state, env)
                folded += 1
            except FoldError:
                _suspect(result, env.session_id)
        last = held[-1]
        owner = last.session_id
        if owner in states:
            counts[owner] = counts.get(owner, 0) + 1
        if positions is not None:
            ends[owner] = (last.index, positions[offset])
            last_ids[owner] = last.event_id
        else:
            ends.pop(owner, None)
    result.folded += folded
    return decodable


async def _deleted_sequences(
    nc: Any, stream: str, state: Mapping[str, Any], timeout: float
) -> frozenset[int]:
    """The stream's deleted sequences, as its info lists them, when it has some and at most
    ``MAX_DELETED_LISTED`` (else none: pages with gaps then place no message)."""
    count = int(state.get("num_deleted") or 0)
    if not count or count > MAX_DELETED_LISTED:
        return frozenset()
    info = await api_request(
        nc, f"{JS_API_PREFIX}.STREAM.INFO.{stream}", {"deleted_details": True}, timeout=timeout
    )
    return frozenset(info.get("state", {}).get("deleted") or ())


def _positions(got: DirectGetPage, start: int, deleted: frozenset[int]) -> Sequence[int] | None:
    """Each message's stream sequence in a page asked for from ``start``: ``start + k`` for the
    k-th of a page with no gaps; in one with gaps, the sequences up to its last less the
    ``deleted`` ones, if those account for every gap (None when they do not: a message deleted
    after the list was read, or no list)."""
    last, count = got.last_sequence, len(got.payloads)
    if last - start + 1 == count:
        return range(start, last + 1)
    if not deleted:
        return None
    kept = [seq for seq in range(start, last + 1) if seq not in deleted]
    return kept if len(kept) == count else None


def _fold_first(
    result: StreamFold,
    env: Envelope,
    skip: set[str],
    waiting: dict[str, ResumePoint],
    current: Mapping[str, ResumePoint],
) -> int:
    """Fold an envelope of a session the pass holds no state for yet (or a ``SessionStarted``):
    passed over in ``skip`` and ``suspect`` sessions and in those ``current`` in their
    checkpoint (one found to go on past it, appended to since the log was counted, is
    ``suspect``), taken from its checkpoint in ``waiting``, else a new state. Answers how many
    envelopes it folded (0 or 1)."""
    states = result.states
    session_id = env.session_id
    if session_id in skip or session_id in result.suspect:
        return 0
    point = current.get(session_id)
    if point is not None:
        if env.index > point.state.last_index:
            _suspect(result, session_id)
        return 0
    folded = states.get(session_id)
    if folded is None:
        point = waiting.get(session_id)
        if point is not None:
            at = point.state.last_index
            if env.index < at:
                return 0  # folded into the checkpoint already
            del waiting[session_id]
            if env.index == at and env.event_id == point.event_id:
                states[session_id] = point.state
                result.resumed.add(session_id)
                if point.messages is None:
                    result.uncounted.add(session_id)
                else:  # the message holding ``at`` is counted in it, and again as it ends
                    result.counts[session_id] = point.messages - 1
            else:  # the log holds something else there: fold it from its start
                result.stale.add(session_id)
                result.suspect.add(session_id)
            return 0
        folded = states[session_id] = new_state(session_id)
    if type(env.event) is SessionStarted:
        env = _shared_shape(result.shapes, env)
    try:
        apply(folded, env)
    except FoldError:
        _suspect(result, session_id)
        return 0
    return 1


def _suspect(result: StreamFold, session_id: str) -> None:
    """A session whose envelopes do not fold: left to be read one by one."""
    result.suspect.add(session_id)
    result.resumed.discard(session_id)
    result.states.pop(session_id, None)
    result.counts.pop(session_id, None)


def _shared_shape(shapes: dict[str, SessionShape], env: Envelope) -> Envelope:
    """``env`` (a ``SessionStarted``) with the shape an earlier session of the same definition
    pinned, when the two are equal: many sessions of one definition then hold one shape (frozen,
    as every event's parts are) instead of a copy each."""
    started = env.event
    assert isinstance(started, SessionStarted)
    shape = started.shape
    seen = shapes.setdefault(shape.definition_digest, shape)
    if seen is shape or seen != shape:
        return env
    return msgspec.structs.replace(env, event=msgspec.structs.replace(started, shape=seen))


async def _undecodable_sessions(
    nc: Any, stream: str, wildcard: str, seq: int, count: int, prefix: str, timeout: float
) -> set[str]:
    """The sessions whose events in the page starting at ``seq`` do not decode (read with
    headers this time, which name each event's subject)."""
    request = {"seq": seq, "next_by_subj": wildcard, "batch": count, "max_bytes": MAX_PAGE_BYTES}
    got = await direct_get_batch(nc, stream, request, timeout=timeout)
    found = set()
    for msg in got.messages:
        try:
            envelopes(msg.data)
        except CodecError:
            subject = (msg.headers or {}).get("Nats-Subject", "")
            if subject.startswith(prefix + "."):
                found.add(subject[len(prefix) + 1 :])
    return found
