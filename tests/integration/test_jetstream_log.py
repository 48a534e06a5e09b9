"""The JetStream log against real nats-servers: corrupt entries, kills and restarts, a server that
is down, listings past a page, an R3 stream on a 3-node cluster, stream settings, heartbeats."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
import nats
import pytest
from tests.contract.test_event_log import events, new_session

from apomesh.adapters import stream_fold
from apomesh.adapters.heartbeats import (
    HEARTBEAT_STREAM,
    HEARTBEAT_WILDCARD,
    HeartbeatStream,
    beat_subject,
)
from apomesh.adapters.jetstream_log import LOG_STREAM, JetStreamLog, _Position
from apomesh.adapters.nats_connect import NATS, close_quietly, connect
from apomesh.adapters.stream_fold import fold_stream
from apomesh.core import envelope
from apomesh.core.errors import (
    AppendConflict,
    LogError,
    LogUnavailable,
    MalformedEnvelope,
    UnknownEventKind,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
async def nc(nats_server: Any) -> AsyncIterator[NATS]:
    client = await connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture
async def log(nc: NATS) -> JetStreamLog:
    made = JetStreamLog(nc)
    await made.ensure()
    return made


async def test_ensure_creates_both_streams_with_the_promised_settings(
    nc: NATS, log: JetStreamLog
) -> None:
    js = nc.jetstream()
    config = (await js.stream_info(LOG_STREAM)).config
    assert config.subjects == ["apomesh.log.*"]
    assert config.allow_direct
    assert (config.duplicate_window or 0) >= 120
    assert config.num_replicas == 1
    heartbeat = (await js.stream_info(HEARTBEAT_STREAM)).config
    assert heartbeat.subjects == [HEARTBEAT_WILDCARD]
    assert heartbeat.max_msgs_per_subject == 1
    await log.ensure()  # idempotent


async def test_bytes_published_straight_onto_a_session_subject_fail_the_read_with_a_typed_error(
    nc: NATS, log: JetStreamLog
) -> None:
    session = new_session()
    await log.append(session, events(session, 0, 3))
    await nc.publish(log.subject(session), b"\x93\x01garbage")
    await nc.flush()
    with anyio.fail_after(5):
        while len(await log.read_raw(session)) < 4:
            await anyio.sleep(0.01)
    with pytest.raises(MalformedEnvelope) as caught:
        await log.read(session)
    assert (caught.value.session_id, caught.value.index) == (session, 3)
    assert f"session {session} index 3" in str(caught.value)
    # An envelope of a kind this build does not know is its own typed error.
    other = new_session()
    unknown = nats_msgpack([1, other, 0, 1.0, "e", {"kind": "FromTheFuture"}])
    await nc.jetstream().publish(log.subject(other), unknown)
    with pytest.raises(UnknownEventKind) as unknown_caught:
        await log.read(other)
    assert (unknown_caught.value.session_id, unknown_caught.value.index) == (other, 0)


def nats_msgpack(value: Any) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(value)


@pytest.mark.parametrize("run_bytes", [1, None], ids=["a-message-per-event", "one-message"])
async def test_a_retry_with_a_stale_position_never_duplicates(
    nc: NATS, run_bytes: int | None
) -> None:
    log = JetStreamLog(nc, run_bytes=run_bytes)
    await log.ensure()
    session = new_session()
    await log.append(session, events(session, 0, 5))
    # Our belief about where the log ends is wrong (older than the truth): re-sending the same
    # step is recognised as already written, for a single event and for a batch.
    for stale in (_Position(2, 1), _Position(-1, 0), _Position(4, 1)):
        log._positions[session] = stale
        await log.append(session, events(session, 3, 2))
        log._positions[session] = stale
        await log.append(session, events(session, 4, 1))
    assert await log.read(session) == events(session, 0, 5)
    # With a stale belief, a new step still lands exactly once after the true end.
    log._positions[session] = _Position(1, 2)
    await log.append(session, events(session, 5, 3))
    assert await log.read(session) == events(session, 0, 8)
    # And another writer's event at those indexes is still a conflict.
    log._positions[session] = _Position(1, 2)
    with pytest.raises(AppendConflict):
        await log.append(session, events(session, 6, 3, tag="other"))
    assert await log.read(session) == events(session, 0, 8)


async def test_a_first_append_with_no_lookup_meets_a_subject_that_holds_events(
    nc: NATS,
) -> None:
    """A log that knows nothing of a session sends its index 0 expecting an empty subject (no
    lookup first): where the subject holds events after all (another process's), the same events
    are settled as already written and different ones are a conflict."""
    session = new_session()
    writer = JetStreamLog(nc)
    await writer.ensure()
    await writer.append(session, events(session, 0, 3))
    await JetStreamLog(nc).append(session, events(session, 0, 2))  # a resend: written once
    with pytest.raises(AppendConflict):
        await JetStreamLog(nc).append(session, events(session, 0, 1, tag="other"))
    assert await writer.read(session) == events(session, 0, 3)
    fresh = new_session()
    await JetStreamLog(nc).append(fresh, events(fresh, 0, 2))
    assert await writer.read(fresh) == events(fresh, 0, 2)


async def test_two_writers_racing_for_one_index_leave_one_step_and_a_conflict(
    nats_cluster: Any,
) -> None:
    """Two writers on their own connections (to two servers of a cluster, an R3 stream) append
    different events at the same index at the same moment (a stale writer thawed while the lease
    holder appends): whichever the stream stores, the other meets ``AppendConflict``, never a
    bare error, also when the server answers that the same message id is being stored right
    now (err_code 10158)."""
    urls = list(nats_cluster.urls)
    clients = [await connect(urls), await connect(list(reversed(urls)))]
    try:
        logs = [JetStreamLog(client, replicas=3) for client in clients]
        await logs[0].ensure()
        for _ in range(30):
            session = new_session()
            await logs[0].append(session, events(session, 0, 3))
            logs[0].forget_position(session)  # both ask the stream where the log ends
            outcomes = await _race(
                logs[0].append(session, events(session, 3, 2, tag="a")),
                logs[1].append(session, events(session, 3, 2, tag="b")),
            )
            assert sorted(type(o).__name__ for o in outcomes) == ["AppendConflict", "NoneType"]
            stored = await logs[0].read(session)
            winner = "a" if outcomes[0] is None else "b"
            assert stored == events(session, 0, 3) + events(session, 3, 2, tag=winner)
    finally:
        for client in clients:
            await close_quietly(client)


async def _race(*appends: Any) -> list[BaseException | None]:
    """Run the appends at once; each one's outcome (None, or the exception it raised)."""
    outcomes: list[BaseException | None] = [None] * len(appends)

    async def one(i: int, append: Any) -> None:
        try:
            await append
        except (AppendConflict, LogError) as exc:
            outcomes[i] = exc

    async with anyio.create_task_group() as group:
        for i, append in enumerate(appends):
            group.start_soon(one, i, append)
    return outcomes


async def test_an_append_is_one_message_and_a_log_of_bare_envelopes_reads_on_after_it(
    nc: NATS, log: JetStreamLog
) -> None:
    """A log written before runs (one bare envelope per message) is read, tailed, folded and
    appended to as before; the appends after it go as one message each."""
    session = new_session()
    js = nc.jetstream()
    for env in events(session, 0, 3):  # the stored form of earlier releases
        await js.publish(
            log.subject(session),
            envelope.encode(env),
            headers={"Nats-Msg-Id": f"{session}:{env.index}"},
        )
    fresh = JetStreamLog(nc)  # knows nothing of where the session ends
    await fresh.append(session, events(session, 3, 4))
    await fresh.append(session, events(session, 7, 1))
    await fresh.append(session, events(session, 8, 3))
    info = await js.stream_info(LOG_STREAM, subjects_filter=log.subject(session))
    assert info.state.subjects == {log.subject(session): 3 + 3}
    everything = events(session, 0, 11)
    reader = JetStreamLog(nc)
    assert await reader.read(session) == everything
    assert await reader.last_index(session) == 10
    for after in range(-1, 11):  # starting inside a run, at its edges and in the bare part
        assert await JetStreamLog(nc).read(session, after=after) == everything[after + 1 :]
    tailed = []
    async with aclosing(JetStreamLog(nc).tail(session, after=4)) as tail:
        async for env in tail:
            tailed.append(env)
            if len(tailed) == 6:
                break
    assert tailed == everything[5:]
    folded = await JetStreamLog(nc).fold_all(set(), sessions=[session])
    assert folded.states[session].last_index == 10 and session not in folded.suspect
    learned = JetStreamLog(nc)
    await learned.learn_ends([session])
    assert learned._positions[session].index == 10


async def test_the_one_pass_notes_where_sessions_end_and_asks_only_past_a_gap(
    nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the pass's pages hold every sequence, each session's end (last index, sequence) is
    read off the pass; a purged session leaves a gap, which the stream's list of deleted
    sequences places; without that list (too many deleted to ask for), the sessions whose last
    message sits in a page with a gap are asked for with ``learn_ends``. Either way the note is
    the truth. The pass also counts each session's messages (three here), which the log's
    appends then count on from; ``learn_ends`` does not tell them."""
    tag = uuid.uuid4().hex[:8]
    options: dict[str, Any] = {
        "stream": f"E_{tag}",
        "subject_prefix": f"e{tag}.log",
        "ensure_heartbeats": False,
    }
    writer = JetStreamLog(nc, **options)
    await writer.ensure()
    sessions = [new_session() for _ in range(6)]
    for round_ in range(3):  # interleaved: two-event appends, a message each
        for session in sessions:
            await writer.append(session, events(session, 2 * round_, 2))
    truth = {
        s: await JetStreamLog(nc, **options)._stored_position(s, time.monotonic() + 5)
        for s in sessions
    }
    assert all(p.messages is None for p in truth.values())  # a lookup does not count them

    def ends(log: JetStreamLog, of: list[str]) -> dict[str, tuple[int, int, int | None]]:
        return {
            s: (log._positions[s].index, log._positions[s].seq, log._positions[s].messages)
            for s in of
        }

    def counted_truth(
        of: list[str], messages: int | None
    ) -> dict[str, tuple[int, int, int | None]]:
        return {s: (truth[s].index, truth[s].seq, messages) for s in of}

    asked: list[list[str]] = []
    learn_ends = JetStreamLog.learn_ends

    async def counted(self: JetStreamLog, session_ids: Any) -> None:
        asked.append(list(session_ids))
        await learn_ends(self, session_ids)

    monkeypatch.setattr(JetStreamLog, "learn_ends", counted)
    dense = JetStreamLog(nc, **options)
    folded = await dense.fold_all(set(), sessions=sessions)
    assert ends(dense, sessions) == counted_truth(sessions, 3)
    assert asked == [[]] and {s: folded.ends[s] for s in sessions} == {
        s: (p.index, p.seq) for s, p in truth.items()
    }

    await writer.delete_session(sessions[0])  # a gap in the stream's sequences
    asked.clear()
    placed = JetStreamLog(nc, **options)
    await placed.fold_all(set(), sessions=sessions[1:])
    assert ends(placed, sessions[1:]) == counted_truth(sessions[1:], 3)
    assert asked == [[]]  # the deleted sequences listed: the gap is placed

    monkeypatch.setattr(stream_fold, "MAX_DELETED_LISTED", 0)
    asked.clear()
    gapped = JetStreamLog(nc, **options)
    await gapped.fold_all(set(), sessions=sessions[1:])
    assert ends(gapped, sessions[1:]) == counted_truth(sessions[1:], None)
    assert asked and set(asked[0]) == set(sessions[1:])  # the one page has the gap
    await nc.jetstream().delete_stream(f"E_{tag}")


async def test_the_one_pass_says_after_each_page_how_far_it_has_read(nc: NATS) -> None:
    """``progress`` hears, page after page, the messages read so far of the sequences the pass
    spans, ending at all of them (what ``apomesh serve`` logs during a long boot scan)."""
    tag = uuid.uuid4().hex[:8]
    stream, prefix = f"P_{tag}", f"p{tag}.log"
    writer = JetStreamLog(nc, stream=stream, subject_prefix=prefix, ensure_heartbeats=False)
    await writer.ensure()
    sessions = [new_session() for _ in range(5)]
    for round_ in range(5):  # 25 messages, interleaved
        for session in sessions:
            await writer.append(session, events(session, 2 * round_, 2))
    heard: list[tuple[int, int]] = []

    folded = await fold_stream(
        nc, stream, prefix, skip=set(), page=10, progress=lambda *told: heard.append(told)
    )

    assert heard == [(10, 25), (20, 25), (25, 25)]
    assert all(folded.states[s].last_index == 9 for s in sessions)
    await nc.jetstream().delete_stream(stream)


async def test_the_pass_reads_by_sequence_and_keeps_another_subjects_messages_out(
    nc: NATS,
) -> None:
    """The pass asks for pages by sequence, with no subject filter. A stream reconfigured from
    other subjects still holds their messages: bytes that are no envelope are passed over, and
    an envelope repeating an index of a session under the prefix makes that session suspect,
    so it is read one by one, from its own subject."""
    tag = uuid.uuid4().hex[:8]
    stream, prefix, old = f"F_{tag}", f"f{tag}.log", f"old{tag}"
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[f"{prefix}.*", f"{old}.*"], allow_direct=True)
    clean, copied = new_session(), new_session()
    await js.publish(f"{old}.{copied}", envelope.encode(events(copied, 0, 1)[0]))
    await js.publish(f"{old}.junk", b"not an envelope")
    writer = JetStreamLog(nc, stream=stream, subject_prefix=prefix, ensure_heartbeats=False)
    await writer.ensure()  # the prefix's subjects alone again; the old messages stay
    assert (await js.stream_info(stream)).config.subjects == [f"{prefix}.*"]
    for session in (clean, copied):
        await writer.append(session, events(session, 0, 3))

    folded = await fold_stream(nc, stream, prefix, skip=set())

    assert folded.states[clean].last_index == 2 and clean not in folded.suspect
    assert copied in folded.suspect and copied not in folded.states
    assert await writer.read(copied) == events(copied, 0, 3)
    await js.delete_stream(stream)


async def test_the_ends_of_many_sessions_are_learned_in_batches_and_a_stale_one_is_refused(
    nc: NATS, log: JetStreamLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("apomesh.adapters.jetstream_log.MULTI_LAST_SUBJECTS", 3)
    sessions = [new_session() for _ in range(7)]
    for number, session in enumerate(sessions):
        await log.append(session, events(session, 0, number + 1))
    fresh = JetStreamLog(nc)
    await fresh.learn_ends([*sessions, new_session()])  # one with no events is passed over
    for number, session in enumerate(sessions):
        known = fresh._positions[session]
        assert known.index == number
        assert known == await log._stored_position(session, time.monotonic() + 5)
    assert len(fresh._positions) == len(sessions)
    # The note goes stale when another writer appends: that writer's index is refused to us.
    session = sessions[2]
    await log.append(session, events(session, 3, 1))
    with pytest.raises(AppendConflict):
        await fresh.append(session, events(session, 3, 1, tag="other"))
    await fresh.append(session, events(session, 4, 1))
    assert await log.read(session) == events(session, 0, 5)


async def test_a_read_that_a_lagging_replica_cut_short_is_completed_from_the_leader(
    log: JetStreamLog,
) -> None:
    session = new_session()
    await log.append(session, events(session, 0, 12))
    read_direct = log._read_direct

    async def lagging(*args: Any) -> Any:
        run = await read_direct(*args)
        run.payloads[5:] = []  # a replica that has not applied the last seven events yet
        return run

    log._read_direct = lagging  # type: ignore[method-assign]
    assert await log.read(session) == events(session, 0, 12)
    assert await log.read(session, after=3) == events(session, 4, 8)


async def test_a_position_note_ahead_of_the_log_does_not_stall_reads(log: JetStreamLog) -> None:
    session = new_session()
    await log.append(session, events(session, 0, 5))
    log._positions[session] = _Position(40, 10**9)  # as if the session was purged and rewritten
    with anyio.fail_after(10):
        assert await log.read(session) == events(session, 0, 5)
    await log.append(session, events(session, 5, 2))
    assert await log.read(session) == events(session, 0, 7)


async def test_reusing_a_deleted_sessions_id_inside_the_duplicate_window_is_refused(
    log: JetStreamLog,
) -> None:
    session = new_session()
    await log.append(session, events(session, 0, 2))
    await log.delete_session(session)
    with pytest.raises(AppendConflict, match="duplicate window"):
        await log.append(session, events(session, 0, 2, tag="again"))
    with pytest.raises(AppendConflict, match="duplicate window"):
        await log.append(session, events(session, 0, 1, tag="again"))
    assert await log.read(session) == []


async def test_listing_pages_past_a_hundred_sessions(nc: NATS) -> None:
    tag = uuid.uuid4().hex[:8]
    log = JetStreamLog(
        nc, stream=f"LIST_{tag}", subject_prefix=f"list{tag}", ensure_heartbeats=False
    )
    await log.ensure()
    sessions = sorted(f"s{number:04d}" for number in range(150))
    js = nc.jetstream()
    pending = [await js.publish_async(log.subject(session), b"x") for session in sessions]
    for future in pending:
        await future
    assert await log.list_sessions() == sessions
    await js.delete_stream(f"LIST_{tag}")


async def test_every_acknowledged_event_survives_a_killed_server(fresh_nats_server: Any) -> None:
    # SIGKILL ends the process, not the machine: the server writes each message to its files
    # before acknowledging it, so the page cache still holds it and the restarted server reads it
    # back. (A power cut is what needs sync_interval "always", or replicas.)
    client = await connect(fresh_nats_server.url)
    try:
        log = JetStreamLog(client, timeout=2.0)
        await log.ensure()
        sessions = [new_session() for _ in range(5)]
        next_index = dict.fromkeys(sessions, 0)
        for step in range(12):
            for session in sessions:
                count = 1 if step % 3 == 0 else 4  # single events and atomic batches
                await log.append(session, events(session, next_index[session], count))
                next_index[session] += count
        written = {session: await log.last_index(session) for session in sessions}
        fresh_nats_server.kill()
        with pytest.raises(LogUnavailable):
            await log.append(sessions[0], events(sessions[0], written[sessions[0]] + 1, 1))
        fresh_nats_server.start()
        with anyio.fail_after(20):
            while not client.is_connected:
                await anyio.sleep(0.05)
        for session in sessions:
            stored = await log.read(session)
            # Every acknowledged event is there; the unacknowledged one may or may not be.
            assert len(stored) - 1 >= written[session]
            assert [envelope.index for envelope in stored] == list(range(len(stored)))
        session = sessions[1]
        await log.append(session, events(session, written[session] + 1, 2))
        assert await log.last_index(session) == written[session] + 2
    finally:
        await close_quietly(client)


async def test_reads_and_appends_against_a_dead_server_raise_log_unavailable_in_bounded_time(
    fresh_nats_server: Any,
) -> None:
    client = await connect(fresh_nats_server.url)
    try:
        log = JetStreamLog(client, timeout=1.0, attempt_timeout=0.5)
        await log.ensure()
        session = new_session()
        await log.append(session, events(session, 0, 2))
        fresh_nats_server.kill()
        started = time.monotonic()
        for call in (
            log.read(session),
            log.read(session, after=0),
            log.last_index(session),
            log.list_sessions(),
            log.append(session, events(session, 2, 3)),
        ):
            with anyio.fail_after(10), pytest.raises(LogUnavailable):
                await call
        assert time.monotonic() - started < 60  # bounded, not a timing claim
    finally:
        await close_quietly(client)


async def test_connecting_to_nothing_is_log_unavailable() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with anyio.fail_after(10), pytest.raises(LogUnavailable, match=f"127.0.0.1:{port}"):
        await connect(f"127.0.0.1:{port}", connect_timeout=1.0)


async def test_a_closed_connection_is_log_unavailable_at_once(nats_server: Any) -> None:
    client = await connect(nats_server.url)
    log = JetStreamLog(client)
    await log.ensure()
    await client.close()
    session = new_session()
    with anyio.fail_after(10), pytest.raises(LogUnavailable):
        await log.append(session, events(session, 0, 1))
    with anyio.fail_after(10), pytest.raises(LogUnavailable):
        await log.read(session)


async def test_ensure_refuses_replicas_a_single_server_cannot_give(nc: NATS) -> None:
    tag = uuid.uuid4().hex[:8]
    options: dict[str, Any] = {
        "stream": f"R_{tag}",
        "subject_prefix": f"r{tag}",
        "ensure_heartbeats": False,
    }
    await JetStreamLog(nc, **options).ensure()
    with pytest.raises(LogError, match="replicas"):
        await JetStreamLog(nc, replicas=3, **options).ensure()
    await nc.jetstream().delete_stream(f"R_{tag}")


async def test_an_r3_stream_on_a_cluster_appends_reads_and_tails(nats_cluster: Any) -> None:
    urls = list(nats_cluster.urls)
    client = await connect(urls)
    reader_client = await connect(list(reversed(urls)))
    try:
        log = JetStreamLog(client, replicas=1)
        await log.ensure()
        # An existing R1 stream is brought to R3 in place.
        log = JetStreamLog(client, replicas=3)
        await log.ensure()
        assert (await client.jetstream().stream_info(LOG_STREAM)).config.num_replicas == 3
        session = new_session()
        await log.append(session, events(session, 0, 1))
        await log.append(session, events(session, 1, 10))
        assert await log.read(session) == events(session, 0, 11)
        reader = JetStreamLog(reader_client, replicas=3)
        assert await reader.read(session, after=4) == events(session, 5, 6)
        assert await reader.last_index(session) == 10
        assert session in await reader.list_sessions()
        await log.append(session, events(session, 8, 5))  # overlapping retry
        assert await reader.read(session) == events(session, 0, 13)
        tailed: list[Any] = []
        with anyio.fail_after(10):
            async with aclosing(reader.tail(session, after=10)) as stream:
                async for envelope in stream:
                    tailed.append(envelope)
                    if len(tailed) == 1:
                        await log.append(session, events(session, 13, 2))
                    if len(tailed) == 4:
                        break
        assert tailed == events(session, 11, 4)
        heartbeats = HeartbeatStream(client, 3)
        await heartbeats.ensure()
        with anyio.fail_after(10):
            # Beats are plain publishes, sent again and again as a worker does: one sent before
            # the new R3 stream has elected its leader is not stored.
            while (await heartbeats.latest()).get("w-r3") != b"alive":
                await client.publish(beat_subject("w-r3"), b"alive")
                await client.flush()
                await anyio.sleep(0.05)
    finally:
        await close_quietly(client)
        await reader_client.close()


async def test_heartbeats_keep_the_latest_beat_of_every_worker(nc: NATS, log: JetStreamLog) -> None:
    heartbeats = HeartbeatStream(nc)
    await heartbeats.ensure()
    workers = [f"w-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    # Workers beat with plain core publishes, no JetStream API.
    plain = await nats.connect(nc.connected_url.geturl() if nc.connected_url else "")
    try:
        for beat in range(3):
            for worker in workers:
                await plain.publish(beat_subject(worker), f"{worker}:{beat}".encode())
        await plain.flush()
    finally:
        await plain.close()
    with anyio.fail_after(10):
        while True:
            latest = await heartbeats.latest()
            if all(latest.get(worker) == f"{worker}:2".encode() for worker in workers):
                break
            await anyio.sleep(0.02)
    info = await nc.jetstream().stream_info(HEARTBEAT_STREAM, subjects_filter=HEARTBEAT_WILDCARD)
    assert all(info.state.subjects and info.state.subjects[beat_subject(w)] == 1 for w in workers)
    await heartbeats.forget(workers[0])
    assert workers[0] not in await heartbeats.latest()
    with pytest.raises(ValueError):
        beat_subject("a.b")


async def test_replies_answer_each_request_with_its_own_reply_and_say_why_none_came(
    nc: NATS,
) -> None:
    """The appends' request path (``Replies``): concurrent requests each get their own answer,
    a subject nobody listens on is ``NoRespondersError`` and a listener that never answers a
    ``TimeoutError`` after the timeout, with nothing left waiting; the answers go straight from
    the parser to their requests (no sink is left behind either)."""
    from apomesh.adapters.nats_connect import Replies
    from apomesh.adapters.nats_parser import SinkParser

    assert isinstance(nc._ps, SinkParser)

    async def echo(msg: Any) -> None:
        await msg.respond(b"re:" + msg.data)

    await nc.subscribe("replies.echo", cb=echo)
    await nc.subscribe("replies.silent")
    replies = Replies(nc)
    answers = []
    async with anyio.create_task_group() as group:

        async def ask(n: int) -> None:
            msg = await replies.request(
                "replies.echo", str(n).encode(), timeout=5, headers={"N": str(n)}
            )
            answers.append((n, msg.data))

        for n in range(50):
            group.start_soon(ask, n)
    assert sorted(answers) == [(n, b"re:" + str(n).encode()) for n in range(50)]
    with pytest.raises(nats.errors.NoRespondersError):
        await replies.request("replies.nobody", b"x", timeout=5, headers={"N": "0"})
    with pytest.raises(nats.errors.TimeoutError):
        await replies.request("replies.silent", b"x", timeout=0.2, headers={"N": "0"})
    assert not replies._waiting
    assert not nc._ps.sinks


async def test_replies_on_a_plain_nats_py_connection(nc: NATS, nats_server: Any) -> None:
    """``Replies`` on a connection without sinks takes its answers through the subscription's
    callback, with the same answers and the same errors."""
    from apomesh.adapters.nats_connect import Replies

    async def echo(msg: Any) -> None:
        await msg.respond(b"re:" + msg.data)

    await nc.subscribe("plain.echo", cb=echo)
    await nc.flush()
    plain = await nats.connect(nats_server.url)
    try:
        replies = Replies(plain)
        answers = [await replies.request("plain.echo", b"%d" % n, timeout=5) for n in range(5)]
        assert [a.data for a in answers] == [b"re:%d" % n for n in range(5)]
        with pytest.raises(nats.errors.NoRespondersError):
            await replies.request("plain.nobody", b"x", timeout=5)
        assert not replies._waiting
    finally:
        await plain.close()


async def test_appends_and_reads_count_a_sessions_messages_where_they_can(nc: NATS) -> None:
    """How many messages a session's subject holds, as this log knows it (what a fold
    checkpoint records, ``known_end``): counted from a session's first append here, on from a
    checkpoint's count by a read from its message, and by a read from the start; not by a
    lookup of where the session ends, nor by a read that starts in the middle."""
    session = new_session()
    writer = JetStreamLog(nc)
    await writer.ensure()
    for start in range(0, 6, 2):  # three appends, a message each
        await writer.append(session, events(session, start, 2))
    seq = writer.known_end(session, 5)
    assert seq is not None and seq[1] == 3
    listed = await writer.count_messages()
    assert listed.counts[session] == 3 and listed.log_id == writer.log_id is not None

    looked_up = JetStreamLog(nc)
    assert await looked_up.last_index(session) == 5
    assert looked_up.known_end(session, 5) == (seq[0], None)
    await looked_up.read(session, after=1)  # from the middle: still not counted
    assert looked_up.known_end(session, 5) == (seq[0], None)
    await looked_up.read(session)  # from the start: every message read, counted
    assert looked_up.known_end(session, 5) == (seq[0], 3)

    from_checkpoint = JetStreamLog(nc)
    end_of_second = seq[0] - 1  # the second append's message, holding index 3
    await from_checkpoint.read_from_sequence(session, 3, end_of_second, counted=2)
    assert from_checkpoint.known_end(session, 5) == (seq[0], 3)
    await from_checkpoint.append(session, events(session, 6, 1))
    assert (from_checkpoint.known_end(session, 6) or (0, None))[1] == 4
