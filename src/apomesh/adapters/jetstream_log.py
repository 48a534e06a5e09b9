"""The event log on NATS JetStream: one stream, one subject per session, optimistic appends.

Stream ``APOMESH_LOG`` holds subjects ``apomesh.log.<session_id>`` (file storage, direct gets
allowed, a two-minute duplicate window). An append's envelopes go as one message, a *run*
(``adapters.log_messages``: cut into several only past the message size limit; logs written
before runs hold one bare envelope per message, and every read takes both). Every message carries
``Nats-Msg-Id: <session_id>:<first index>`` (dedupe on retry) and every publish carries
``Nats-Expected-Last-Subject-Sequence`` (optimistic concurrency), so a stale writer is refused.

Why a run. The expected-sequence header of a message needs the stream sequence of the one before
it, known only once that one is acknowledged, so a step whose events went as a message each cost
one awaited request per event (pipelining them with the header on the first only would be
unsafe: if the first is refused because another writer got there, the others would still be
stored after that writer's events; the ownership lease cannot stop a paused process that wakes
up believing it still holds one, so every stored message must pass the check). An atomic batch
is stored whole or not at all in one round trip, but the server stages each in a temporary file
store, about 2.7 ms a batch, serialised across the stream. A run is one message: one request, one
check, one fsync at ``sync_interval: always``, and stored whole or not at all like any message.
An append cut into several runs (events over the limit together) sends them chained; a crash
between them leaves the first runs stored, and the retry after it settles what is stored and
sends only the rest.

Retries: a timeout or disconnect resends the same run with the same expected sequence and
message id. If the first try was stored, the resend is refused (wrong last sequence) or
acknowledged as a duplicate; each of those means "maybe written",
and the session's stored tail is then compared with what we sent: our own events (same bytes, or
same index and event id) count as written, anything else is ``AppendConflict``. So a retried
append never duplicates and never loses an event. A server that stays out of reach is
``LogUnavailable`` after ``timeout`` seconds, never a hang.

Durability: an acknowledged event has been written to the server's files, so it survives the
server process being killed. The server fsyncs every two minutes by default, so a machine crash or
power cut can lose the last ones unless it runs with ``sync_interval: always`` (``sync_always``
records which promise the deployment makes; the embedded server is started accordingly), or the
stream is replicated (R3), where an acknowledgement means a majority of servers hold the event.

Reads use batched direct gets without headers (one request per page of up to ``read_page``
messages), which measured two to three times faster than an ordered consumer at every session
size tried, 10 to 50k events (bench/bench_log.py), so there is no size past which a consumer
takes over. If a direct get answers with less than this process knows is stored (a lagging
replica of an R3 stream may answer direct gets), the leader says where the log ends and the rest
is read through an ordered consumer, which the leader serves. Appends look the session's end up
from the leader too (message get, not direct get), so a lagging replica never misleads a retry.
``tail`` reads through an ordered consumer that starts at the stream sequence of the message
holding the first wanted index, so nothing is missed or repeated between history and live.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from apomesh.adapters.heartbeats import HeartbeatStream
from apomesh.adapters.log_messages import Run, entries, index_range, pack
from apomesh.adapters.memory_log import (
    DEFAULT_MAX_EVENT_BYTES,
    OutgoingEvent,
    check_dense,
    check_session_id,
    decode_entry,
    gap_conflict,
    prepare_batch,
    settle_overlap,
)
from apomesh.adapters.nats_connect import (
    JS_API_PREFIX,
    NATS,
    UNAVAILABLE_ERRORS,
    Replies,
    api_request,
    direct_get_batch,
    read_pub_ack,
    unavailable_as_log_error,
)
from apomesh.adapters.stream_fold import ResumePoint, StreamFold, fold_stream
from apomesh.core.envelope import Envelope, decode
from apomesh.core.errors import AppendConflict, LogError, LogUnavailable
from apomesh.core.ports import EventLog

LOG_STREAM = "APOMESH_LOG"
LOG_SUBJECT_PREFIX = "apomesh.log"
DUPLICATE_WINDOW_SECONDS = 120.0
MULTI_LAST_SUBJECTS = 1000
"""Sessions per batched direct get of their last events (``learn_ends``)."""


def log_subject(session_id: str, prefix: str = LOG_SUBJECT_PREFIX) -> str:
    """The subject a session's events are stored under."""
    check_session_id(session_id)
    return f"{prefix}.{session_id}"


class _Position(msgspec.Struct, frozen=True):
    """Where a session's log ends: its last index, that event's stream sequence and, when this
    log knows it, how many messages the session's subject holds (counted from its first append
    here, or from a pass that read them all)."""

    index: int
    seq: int
    messages: int | None = None


_EMPTY = _Position(-1, 0, 0)


class MessageCounts(msgspec.Struct, frozen=True):
    """How many messages each session's subject holds, on the stream ``log_id`` names (its
    creation time)."""

    counts: dict[str, int]
    log_id: str | None


class _StoredRun(msgspec.Struct, frozen=True):
    """Consecutive stored events of one session: their bytes from index ``first`` on, the
    stream sequence of the last one (0 when there are none), and how many messages were read
    for them."""

    first: int
    payloads: list[bytes]
    last_seq: int
    messages: int = 0

    def entries(self) -> list[tuple[int, bytes]]:
        return [(self.first + offset, data) for offset, data in enumerate(self.payloads)]


class _IndexProbe(msgspec.Struct, array_like=True):
    """The head of an envelope: enough to check an entry's index without decoding its event."""

    v: int
    session_id: str
    index: int


_probe_decode = msgspec.msgpack.Decoder(_IndexProbe).decode


def _probe_index(data: bytes) -> int | None:
    """The index an entry's bytes claim, or None when they are not an envelope (``read`` will
    then raise the codec's typed error for them)."""
    try:
        return _probe_decode(data).index
    except msgspec.MsgspecError:
        return None


_Outcome = Literal["written", "wrong_last", "duplicate", "transient"]


class JetStreamLog:
    """``EventLog`` on a JetStream stream; see the module docstring for the guarantees."""

    def __init__(
        self,
        nc: NATS,
        *,
        replicas: int = 1,
        stream: str = LOG_STREAM,
        subject_prefix: str = LOG_SUBJECT_PREFIX,
        sync_always: bool = False,
        timeout: float = 5.0,
        attempt_timeout: float = 2.0,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        read_page: int = 5000,
        position_cache_size: int = 100_000,
        ensure_heartbeats: bool = True,
        run_bytes: int | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self._nc = nc
        self._replies = Replies(nc)
        self._js = nc.jetstream(timeout=timeout)
        self.replicas = replicas
        self.stream = stream
        self.subject_prefix = subject_prefix
        self.sync_always = sync_always
        self._timeout = timeout
        self._attempt_timeout = attempt_timeout
        self._max_event_bytes = max_event_bytes
        self._run_bytes = min(run_bytes or max_event_bytes, max_event_bytes)
        self._read_page = read_page
        self._positions: OrderedDict[str, _Position] = OrderedDict()
        self._position_cache_size = position_cache_size
        self._ensure_heartbeats = ensure_heartbeats
        self.log_id: str | None = None
        """The stream's creation time, once ``ensure`` has read it: what a message count is
        counted on (a stream deleted and made again has another)."""

    @property
    def durability(self) -> str:
        """The durability an acknowledged append has, in words (for health pages and docs)."""
        copies = "a majority of replicas" if self.replicas > 1 else "the server's files"
        sync = (
            "fsynced before the ack"
            if self.sync_always
            else "fsynced within the server's sync_interval"
        )
        return f"written to {copies}, {sync}"

    def subject(self, session_id: str) -> str:
        return log_subject(session_id, self.subject_prefix)

    # -- stream setup ------------------------------------------------------------------------

    def _wanted_config(self) -> StreamConfig:
        return StreamConfig(
            name=self.stream,
            description="apomesh event log: one subject per session",
            subjects=[f"{self.subject_prefix}.*"],
            storage=StorageType.FILE,
            num_replicas=self.replicas,
            allow_direct=True,
            duplicate_window=DUPLICATE_WINDOW_SECONDS,
            max_msg_size=self._max_event_bytes + 4096,
            deny_delete=True,
            deny_purge=False,
        )

    async def ensure(self) -> None:
        """Create the log stream, or bring an existing one to the wanted settings.

        Replicas, direct gets, atomic batches and a too-short duplicate window are updated in
        place; a stream on memory storage or one whose update the server refuses is a
        ``LogError`` saying what differs.
        """
        wanted = self._wanted_config()
        with unavailable_as_log_error(f"ensure stream {self.stream}"):
            try:
                info = await self._js.stream_info(self.stream)
            except nats.js.errors.NotFoundError:
                try:
                    await self._js.add_stream(wanted)
                except nats.js.errors.APIError as exc:
                    raise LogError(
                        f"cannot create stream {self.stream}: {exc.description}"
                    ) from None
            else:
                await self._reconcile_stream(info.config, wanted)
        # As the server writes it (nats-py's own parse rounds it): what ``count_messages`` reads.
        answer = await api_request(
            self._nc, f"{JS_API_PREFIX}.STREAM.INFO.{self.stream}", {}, timeout=self._timeout
        )
        self.log_id = answer.get("created")
        if self._ensure_heartbeats:
            await HeartbeatStream(self._nc, self.replicas, timeout=self._timeout).ensure()

    async def _reconcile_stream(self, current: StreamConfig, wanted: StreamConfig) -> None:
        if current.storage != StorageType.FILE:
            raise LogError(
                f"stream {self.stream} uses {current.storage} storage; the log needs file storage"
            )
        changes: dict[str, Any] = {}
        if set(current.subjects or []) != set(wanted.subjects or []):
            changes["subjects"] = wanted.subjects
        if (current.num_replicas or 1) != self.replicas:
            changes["num_replicas"] = self.replicas
        if not current.allow_direct:
            changes["allow_direct"] = True
        if (current.duplicate_window or 0) < DUPLICATE_WINDOW_SECONDS:
            changes["duplicate_window"] = DUPLICATE_WINDOW_SECONDS
        if (current.max_msg_size or -1) not in (-1, wanted.max_msg_size) and (
            current.max_msg_size or 0
        ) < (wanted.max_msg_size or 0):
            changes["max_msg_size"] = wanted.max_msg_size
        if not changes:
            return
        try:
            await self._js.update_stream(replace(current, **changes))
        except nats.js.errors.APIError as exc:
            described = ", ".join(
                f"{key}={getattr(current, key)!r} (wanted {value!r})"
                for key, value in changes.items()
            )
            raise LogError(
                f"stream {self.stream} differs from the wanted settings: {described};"
                f" the server refused to update it: {exc.description}"
            ) from None

    # -- appends -----------------------------------------------------------------------------

    async def append(self, session_id: str, envelopes: Sequence[Envelope]) -> None:
        pending = prepare_batch(session_id, envelopes, max_event_bytes=self._max_event_bytes)
        if not pending:
            return
        subject = self.subject(session_id)
        deadline = time.monotonic() + self._timeout
        position = self._positions.get(session_id)
        if position is None and pending[0].index == 0:
            # A new session's first append: expect an empty subject rather than ask the stream
            # first (a round trip a session); a subject that holds events refuses it, and the
            # refusal is settled like any stale belief.
            position = _EMPTY
        verified = False
        problem = "no answer"
        backoff = 0.02
        runs: list[Run] = []
        while pending:
            if position is None:
                position, verified = await self._stored_position(session_id, deadline), True
            first = pending[0].index
            if position.index >= first:
                pending, position = await self._settle(session_id, pending, position, deadline)
                runs = []
                continue
            if position.index < first - 1:
                if not verified:  # only a belief from earlier calls: ask the stream before refusing
                    position, verified = await self._stored_position(session_id, deadline), True
                    continue
                raise gap_conflict(session_id, first, position.index)
            if not runs:
                runs = pack(session_id, pending, self._run_bytes)
            run = runs[0]
            outcome, seq, detail = await self._publish(
                subject, session_id, run, position.seq, deadline
            )
            if outcome == "written":
                counted = position.messages
                position = _Position(run.last, seq, None if counted is None else counted + 1)
                self._remember(session_id, position)
                pending = pending[run.last - run.first + 1 :]
                runs = runs[1:]  # packing is greedy from the front: the rest stay as they were
                backoff = 0.02
                continue
            if outcome == "transient":
                problem = detail
                if time.monotonic() + backoff >= deadline:
                    raise LogUnavailable(
                        f"append to session {session_id}: not acknowledged within"
                        f" {self._timeout:g} s ({problem})"
                    )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
                continue
            # "maybe written": learn where the session's log really ends and settle from there.
            self._positions.pop(session_id, None)
            runs = []
            fresh = await self._stored_position(session_id, deadline)
            if fresh == position:
                if outcome == "duplicate":
                    raise AppendConflict(
                        f"session {session_id}: message ids {session_id}:{first}.. were used within"
                        " the duplicate window but are not in the log (was the session deleted and"
                        " its id reused?)"
                    )
                raise LogError(
                    f"session {session_id}: the server refused an append that continues its log ({detail})"
                )
            position, verified = fresh, True
        if position is not None:
            self._remember(session_id, position)

    async def _publish(
        self, subject: str, session_id: str, run: Run, expected_seq: int, deadline: float
    ) -> tuple[_Outcome, int, str]:
        """Send one run; return the outcome, the stream sequence it was stored at, and a detail."""
        timeout = min(self._attempt_timeout, deadline - time.monotonic())
        if timeout <= 0:
            return "transient", 0, "deadline reached"
        headers = {
            "Nats-Msg-Id": run.msg_id(session_id),
            "Nats-Expected-Last-Subject-Sequence": str(expected_seq),
        }
        try:
            reply = await self._replies.request(
                subject, run.payload, timeout=timeout, headers=headers
            )
        except nats.errors.ConnectionClosedError:
            raise LogUnavailable(
                f"append to session {session_id}: the NATS connection is closed"
            ) from None
        except UNAVAILABLE_ERRORS as exc:
            return "transient", 0, f"{type(exc).__name__}: {exc}".rstrip(": ")
        ack = read_pub_ack(reply.data, f"append to session {session_id}")
        if ack.error is None:
            if ack.duplicate:
                return "duplicate", ack.seq, "duplicate acknowledgement"
            return "written", ack.seq, ""
        if ack.wrong_last_sequence:
            return "wrong_last", 0, ack.error.description
        if ack.transient:
            return "transient", 0, ack.error.description
        raise LogError(f"append to session {session_id} refused: {ack.reason}")

    async def _settle(
        self, session_id: str, pending: list[OutgoingEvent], position: _Position, deadline: float
    ) -> tuple[list[OutgoingEvent], _Position]:
        """The log already reaches our first index: keep what is ours, refuse what is not."""
        first = pending[0].index
        run = await self._read_stored(session_id, first - 1, deadline, at_least=position.index)
        entries = run.entries()
        _check_run(session_id, entries)
        remaining = settle_overlap(session_id, pending, entries)
        if run.payloads:
            return remaining, _Position(first + len(run.payloads) - 1, run.last_seq)
        # What we believed stored is not there (a purged session): start again from the leader.
        self._positions.pop(session_id, None)
        fresh = await self._stored_position(session_id, deadline)
        if fresh.index >= first:
            raise LogError(
                f"session {session_id}: its last index is {fresh.index} but no event follows {first - 1}"
            )
        return remaining, fresh

    def _remember(self, session_id: str, position: _Position, *, leader: bool = False) -> None:
        """Note where the session ends. A direct get may come from a lagging replica, so it never
        moves the note backwards; the stream leader's answer (``leader``) always wins."""
        known = self._positions.get(session_id)
        if known is not None:
            if known.seq > position.seq and not leader:
                return
            if (
                position.messages is None
                and known.messages is not None
                and (known.index, known.seq) == (position.index, position.seq)
            ):
                position = known  # the same end, whose message count this log knows
        self._positions[session_id] = position
        self._positions.move_to_end(session_id)
        if len(self._positions) > self._position_cache_size:
            self._positions.popitem(last=False)

    def forget_position(self, session_id: str) -> None:
        """Drop what this log remembers of the session's end (the next append looks it up)."""
        self._positions.pop(session_id, None)

    async def _stored_position(self, session_id: str, deadline: float) -> _Position:
        """The session's last index and sequence as the stream leader sees it."""
        subject = self.subject(session_id)
        while True:
            timeout = max(0.05, min(self._attempt_timeout, deadline - time.monotonic()))
            try:
                answer = await api_request(
                    self._nc,
                    f"{JS_API_PREFIX}.STREAM.MSG.GET.{self.stream}",
                    {"last_by_subj": subject},
                    timeout=timeout,
                )
            except LogUnavailable as exc:
                if time.monotonic() >= deadline or self._nc.is_closed:
                    raise LogUnavailable(
                        f"find the end of session {session_id}: {exc.message}"
                    ) from None
                await asyncio.sleep(0.05)
                continue
            except LogError as exc:
                if "no message found" in str(exc):
                    self._positions.pop(session_id, None)
                    return _EMPTY
                raise
            message = answer["message"]
            seq = int(message["seq"])
            data = base64.b64decode(message.get("data") or b"")
            _, index = _message_range(data, session_id)
            position = _Position(index, seq)
            self._remember(session_id, position, leader=True)
            return position

    # -- reads -------------------------------------------------------------------------------

    async def last_index(self, session_id: str) -> int:
        position = await self._last_direct(session_id, time.monotonic() + self._timeout)
        return position.index

    async def _last_direct(self, session_id: str, deadline: float) -> _Position:
        subject = self.subject(session_id)
        timeout = max(0.05, deadline - time.monotonic())
        with unavailable_as_log_error(f"last index of session {session_id}"):
            reply = await self._nc.request(
                f"{JS_API_PREFIX}.DIRECT.GET.{self.stream}.{subject}", b"", timeout=timeout
            )
        headers = reply.headers or {}
        status = headers.get("Status") if not reply.data else None
        if status == "404":
            return _EMPTY
        if status is not None:
            raise LogError(f"last index of session {session_id}: direct get answered {status}")
        seq = int(headers["Nats-Sequence"])
        _, index = _message_range(reply.data, session_id)
        position = _Position(index, seq)
        self._remember(session_id, position)
        return position

    async def read(self, session_id: str, after: int = -1) -> list[Envelope]:
        # decode_entry checks each envelope's session and index, so no separate probe is needed.
        return [
            decode_entry(session_id, index, data)
            for index, data in await self._entries_after(session_id, after)
        ]

    async def read_from_sequence(
        self, session_id: str, index: int, seq: int, counted: int | None = None
    ) -> list[Envelope]:
        """The session's envelopes from ``index`` on, read from stream sequence ``seq``, where the
        caller believes the envelope at ``index`` is stored (a fold checkpoint says so, and that
        the session held ``counted`` messages up to that one, when it counted them): no lookup
        of where to start. A wrong belief (the log was purged or replaced since) answers an
        empty list or raises the ``FoldError`` of the first envelope not at ``index``."""
        deadline = time.monotonic() + self._timeout
        run = await self._read_direct(self.subject(session_id), session_id, index, seq, deadline)
        entries = run.entries()
        if entries and _probe_index(entries[0][1]) == index:
            # The message at ``seq`` is the one the count ends with: the rest follow it.
            messages = None if counted is None else counted - 1 + run.messages
            self._remember(session_id, _Position(index + len(entries) - 1, run.last_seq, messages))
        return [decode_entry(session_id, i, data) for i, data in entries]

    def known_end(self, session_id: str, index: int) -> tuple[int, int | None] | None:
        """Where the session's event ``index`` is, if this log knows it (it is where the session
        ends, as last appended or read here): its stream sequence, and how many messages the
        session's subject holds up to it when that is known too; else None."""
        known = self._positions.get(session_id)
        if known is None or known.index != index:
            return None
        return known.seq, known.messages

    async def read_raw(self, session_id: str, after: int = -1) -> list[tuple[int, bytes]]:
        entries = await self._entries_after(session_id, after)
        _check_run(session_id, entries)
        return entries

    async def _entries_after(self, session_id: str, after: int) -> list[tuple[int, bytes]]:
        deadline = time.monotonic() + self._timeout
        known = self._positions.get(session_id)
        at_least = known.index if known else -1
        return (await self._read_stored(session_id, after, deadline, at_least=at_least)).entries()

    async def _read_stored(
        self, session_id: str, after: int, deadline: float, *, at_least: int
    ) -> _StoredRun:
        """The stored events with index > ``after``; redone through a consumer when a lagging
        replica answered with less than ``at_least`` (the last index this process knows is
        stored)."""
        first = max(after, -1) + 1
        subject = self.subject(session_id)
        start_seq = await self._start_seq_after(session_id, after, deadline)
        if start_seq is None:
            return _StoredRun(first, [], 0)
        run = await self._read_direct(subject, session_id, first, start_seq, deadline)
        if first + len(run.payloads) - 1 < at_least:
            # Less than we know is stored: ask the leader where the log ends (our note may be
            # wrong too, after a purge elsewhere), and read the rest from it if it has more.
            leader = await self._stored_position(session_id, deadline)
            if leader.index >= first + len(run.payloads):
                run = await self._read_by_consumer(
                    subject, session_id, first, start_seq, leader.index - first + 1, deadline
                )
        if run.payloads:
            # Read from the subject's first message, every one of them is counted.
            messages = run.messages if after < 0 else None
            self._remember(
                session_id, _Position(first + len(run.payloads) - 1, run.last_seq, messages)
            )
        return run

    async def _read_direct(
        self, subject: str, session_id: str, first: int, start_seq: int, deadline: float
    ) -> _StoredRun:
        # ``no_hdr`` leaves every header out: parsing them costs nats-py more than the rest of
        # the read (measured: 10k events in ~70 ms without, ~250 ms with). The end-of-batch
        # status still gives the sequence of the last message sent; indexes are positions,
        # checked against each envelope's own index. Without headers, nats-server 2.15 counts
        # the pending messages from before the page, so "nothing left" is read from an empty
        # page (or a zero count, should a server count after it), never from that count.
        payloads: list[bytes] = []
        seq, last_seq, messages = start_seq, 0, 0
        while True:
            page = await direct_get_batch(
                self._nc,
                self.stream,
                {
                    "seq": seq,
                    "next_by_subj": subject,
                    "batch": self._read_page,
                    "max_bytes": 16 * 1024 * 1024,
                    "no_hdr": True,
                },
                timeout=_remaining(deadline, f"read session {session_id}"),
            )
            for payload in page.payloads:
                _take(payloads, payload, first)
            messages += len(page.payloads)
            if page.payloads:
                last_seq = page.last_sequence
            if not page.payloads or page.pending == 0:
                return _StoredRun(first, payloads, last_seq, messages)
            seq = last_seq + 1

    async def _read_by_consumer(
        self,
        subject: str,
        session_id: str,
        first: int,
        start_seq: int,
        count: int,
        deadline: float,
    ) -> _StoredRun:
        """Read at least ``count`` events from ``start_seq`` through an ordered consumer."""
        payloads: list[bytes] = []
        messages = 0
        with unavailable_as_log_error(f"read session {session_id}"):
            subscription = await self._subscribe_from(subject, start_seq)
            try:
                while True:
                    msg = await subscription.next_msg(
                        timeout=_remaining(deadline, f"read session {session_id}")
                    )
                    _take(payloads, msg.data, first)
                    messages += 1
                    if len(payloads) >= count and msg.metadata.num_pending == 0:
                        return _StoredRun(first, payloads, msg.metadata.sequence.stream, messages)
            finally:
                await _unsubscribe_quietly(subscription)

    async def _subscribe_from(self, subject: str, start_seq: int) -> Any:
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            filter_subject=subject,
        )
        return await self._js.subscribe(
            subject, stream=self.stream, ordered_consumer=True, config=config
        )

    async def _start_seq_after(self, session_id: str, after: int, deadline: float) -> int | None:
        """The stream sequence of the session's event ``after + 1``; None when there is none."""
        if after < 0:
            return 1
        last = await self._last_direct(session_id, deadline)
        if after >= last.index:
            return None
        if after == last.index - 1:
            return last.seq
        # Indexes rise with stream sequences, so a binary search over sequences finds the message
        # holding ``after + 1`` in O(log n) direct gets without a per-session index of sequences.
        subject = self.subject(session_id)
        low, high = 1, last.seq
        while low < high:
            middle = (low + high) // 2
            seq, first, last_held = await self._first_at_or_after(
                subject, session_id, middle, deadline
            )
            if last_held > after:
                if first <= after + 1:
                    return seq
                high = middle
            else:
                low = seq + 1
        return (await self._first_at_or_after(subject, session_id, low, deadline))[0]

    async def _first_at_or_after(
        self, subject: str, session_id: str, seq: int, deadline: float
    ) -> tuple[int, int, int]:
        """The first message of the session at or after stream sequence ``seq``: its sequence and
        the first and last index it holds."""
        page = await direct_get_batch(
            self._nc,
            self.stream,
            {"seq": seq, "next_by_subj": subject, "batch": 1},
            timeout=_remaining(deadline, f"read session {session_id}"),
        )
        if not page.messages:
            raise LogError(f"session {session_id}: no message at or after stream sequence {seq}")
        msg = page.messages[0]
        headers = msg.headers or {}
        first, last = _message_range(msg.data, session_id)
        return int(headers["Nats-Sequence"]), first, last

    async def tail(self, session_id: str, after: int = -1) -> AsyncIterator[Envelope]:
        subject = self.subject(session_id)
        deadline = time.monotonic() + self._timeout
        start_seq = await self._start_seq_after(session_id, after, deadline)
        if start_seq is None:
            # Nothing after ``after`` was stored a moment ago: start just past the last stored
            # event, unless one was appended since (then look its sequence up, or the consumer
            # would start after it and the tail would skip it).
            last = await self._last_direct(session_id, deadline)
            if last.index <= after:
                start_seq = last.seq + 1
            else:
                found = await self._start_seq_after(session_id, after, deadline)
                if found is None:
                    raise LogError(f"session {session_id}: event {after + 1} vanished from the log")
                start_seq = found
        with unavailable_as_log_error(f"tail session {session_id}"):
            subscription = await self._subscribe_from(subject, start_seq)
        expected = max(after, -1) + 1
        try:
            while True:
                try:
                    msg = await subscription.next_msg(timeout=None)
                except nats.errors.TimeoutError:
                    continue
                except nats.errors.ConnectionClosedError:
                    raise LogUnavailable(
                        f"tail session {session_id}: the NATS connection is closed"
                    ) from None
                first, payloads = entries(msg.data)
                for offset, data in enumerate(payloads):
                    if first is not None and first + offset < expected:
                        continue  # before ``after`` (a scan from the session's start)
                    envelope = decode_entry(session_id, expected, data)
                    expected += 1
                    yield envelope
        finally:
            await _unsubscribe_quietly(subscription)

    # -- the whole stream ----------------------------------------------------------------------

    async def fold_all(
        self,
        skip: set[str],
        *,
        resume: Mapping[str, ResumePoint] | None = None,
        sessions: Collection[str] | None = None,
        counts: MessageCounts | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> StreamFold:
        """Every session folded in one pass over the stream (``adapters.stream_fold``), passing
        over the sessions in ``skip`` and starting those in ``resume`` from their fold checkpoint
        (from its sequence on when every one of ``sessions`` has one); those the pass cannot
        vouch for are ``suspect``; those whose checkpoint ``counts`` (``count_messages``) shows
        current are not read. Where the unfinished ones end is noted too, with their message
        counts (by the pass where its pages are dense, else ``learn_ends``): the boot scan
        resumes them next. ``progress`` is told after each page how many messages were read of
        how many."""
        folded = await fold_stream(
            self._nc,
            self.stream,
            self.subject_prefix,
            skip=skip,
            resume=resume,
            sessions=sessions,
            counts=None if counts is None else counts.counts,
            log_id=None if counts is None else counts.log_id,
            progress=progress,
        )
        unknown = []
        for session_id, state in folded.states.items():
            if state.terminal:
                continue
            end = folded.ends.get(session_id)
            if end is not None and end[0] == state.last_index:
                self._remember(session_id, _Position(*end, folded.counts.get(session_id)))
            else:
                unknown.append(session_id)
        with contextlib.suppress(LogError):  # only a head start: appends look ends up anyway
            await self.learn_ends(unknown)
        return folded

    async def learn_ends(self, session_ids: Sequence[str]) -> None:
        """Note where each session's log ends (its last index and that event's stream sequence),
        asking for the last event of ``MULTI_LAST_SUBJECTS`` sessions per batched direct get, so
        that their next appends need no lookup each (thousands of sessions resumed at once would
        otherwise each send one). A note is only a belief: an append it misleads is refused by
        the expected-sequence check and looks the end up from the leader (see ``append``)."""
        prefix = f"{self.subject_prefix}."
        for first in range(0, len(session_ids), MULTI_LAST_SUBJECTS):
            subjects = [self.subject(s) for s in session_ids[first : first + MULTI_LAST_SUBJECTS]]
            page = await direct_get_batch(
                self._nc,
                self.stream,
                {"multi_last": subjects, "batch": len(subjects)},
                timeout=self._timeout,
            )
            for msg in page.messages:
                headers = msg.headers or {}
                subject, seq = headers.get("Nats-Subject", ""), headers.get("Nats-Sequence")
                if not subject.startswith(prefix) or seq is None:
                    continue
                session_id = subject[len(prefix) :]
                held = index_range(msg.data)
                if held is not None:
                    self._remember(session_id, _Position(held[1], int(seq)))

    # -- listing and deleting ----------------------------------------------------------------

    async def list_sessions(self) -> list[str]:
        """Every session id with entries, paged past the server's per-answer subject limit."""
        return sorted((await self.count_messages()).counts)

    async def count_messages(self) -> MessageCounts:
        """How many messages each session's subject holds (every session with entries), and the
        stream's creation time, read in pages past the server's per-answer subject limit."""
        prefix = f"{self.subject_prefix}."
        counts: dict[str, int] = {}
        created: str | None = None
        offset = 0
        while True:
            answer = await api_request(
                self._nc,
                f"{JS_API_PREFIX}.STREAM.INFO.{self.stream}",
                {"subjects_filter": f"{prefix}*", "offset": offset},
                timeout=self._timeout,
            )
            created = created or answer.get("created")
            subjects: dict[str, int] = answer.get("state", {}).get("subjects") or {}
            start = len(prefix)
            counts.update(
                (subject[start:], count)
                for subject, count in subjects.items()
                if subject.startswith(prefix)
            )
            offset += len(subjects)
            if not subjects or offset >= int(answer.get("total", 0)):
                return MessageCounts(counts, created)

    async def delete_session(self, session_id: str) -> None:
        """Purge the session's events (tests and operators). Its message ids stay in the
        duplicate window for two minutes, so reusing the id at once is refused."""
        subject = self.subject(session_id)
        with unavailable_as_log_error(f"delete session {session_id}"):
            await self._js.purge_stream(self.stream, subject=subject)
        self._positions.pop(session_id, None)


def _check_run(session_id: str, entries: list[tuple[int, bytes]]) -> None:
    """Raise ``IndexGap``/``DuplicateIndex`` when a stored envelope is not at its own index."""
    for position, data in entries:
        claimed = _probe_index(data)
        if claimed is not None:
            check_dense(session_id, position, claimed)


def _remaining(deadline: float, what: str) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise LogUnavailable(f"{what}: NATS did not answer in time")
    return remaining


def _take(payloads: list[bytes], data: bytes, first: int) -> None:
    """Add a stored message's envelopes to ``payloads``, which are to start at index ``first``:
    a leading message holding earlier ones too (a run that starts before it) gives only the
    rest. What follows is taken whole, to be checked index by index by the caller."""
    held_from, held = entries(data)
    if not payloads and held_from is not None and held_from < first:
        held = held[first - held_from :]
    payloads.extend(held)


def _message_range(data: bytes, session_id: str) -> tuple[int, int]:
    """The first and last index a stored message of the session holds (the codec's typed error,
    naming the session, when its bytes are neither form)."""
    held = index_range(data)
    if held is None:
        index = decode(data, session_id=session_id).index  # raises the typed error
        return index, index
    return held


async def _unsubscribe_quietly(subscription: Any) -> None:
    with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
        await subscription.unsubscribe()


def _is_an_event_log(log: JetStreamLog) -> EventLog:
    """Never called: lets the type checker prove ``JetStreamLog`` satisfies the ``EventLog`` port."""
    return log
