"""The ``EventLog`` contract, run on the in-memory twin and on JetStream (a real nats-server),
the latter with both append paths (chained publishes and atomic batches).

Each JetStream test gets its own stream and subject prefix on the module's server, so listings
are exact. What only the real server can show (kills, restarts, clusters, paging) lives in
tests/integration/test_jetstream_log.py.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import anyio
import pytest

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.memory_log import MemoryLog
from apomesh.adapters.nats_connect import connect
from apomesh.core.envelope import Envelope, make
from apomesh.core.errors import AppendConflict, MalformedEnvelope, PayloadTooLarge
from apomesh.core.events import CoordinatorCheckpoint

Log = MemoryLog | JetStreamLog
TS = 1_700_000_000.0


def events(
    session_id: str, start: int, count: int, tag: str = "a", size: int = 32
) -> list[Envelope]:
    """``count`` envelopes of ``session_id`` from index ``start``; ``tag`` makes their ids differ."""
    return [
        make(
            session_id,
            index,
            TS + index,
            f"{tag}-{index}",
            CoordinatorCheckpoint(position=f"{tag}{index}", state=bytes(size)),
        )
        for index in range(start, start + count)
    ]


def new_session() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


class LogUnderTest:
    """The log, a second writer on the same storage, and a way to plant raw bytes."""

    def __init__(
        self,
        log: Log,
        second_writer: Callable[[], Log],
        plant: Callable[[str, bytes], Awaitable[None]],
    ) -> None:
        self.log = log
        self.second_writer = second_writer
        self.plant = plant


@pytest.fixture(params=["memory", "jetstream", "jetstream-split"])
async def subject_log(request: pytest.FixtureRequest) -> AsyncIterator[LogUnderTest]:
    if request.param == "memory":
        memory = MemoryLog()

        async def plant_memory(session_id: str, data: bytes) -> None:
            memory.append_raw(session_id, data)

        yield LogUnderTest(memory, lambda: memory, plant_memory)
        return
    server: Any = request.getfixturevalue("nats_server")
    nc = await connect(server.url)
    tag = uuid.uuid4().hex[:8]
    options: dict[str, Any] = {
        "stream": f"T_{tag}",
        "subject_prefix": f"t{tag}.log",
        "ensure_heartbeats": False,
        # A step's events go as one message by default; this variant sends each as a message of
        # its own (runs of one event, chained), so both ways of storing an append meet the same
        # contract, and reads of every size cross small pages.
        "run_bytes": 1 if request.param == "jetstream-split" else None,
        "read_page": 7 if request.param == "jetstream-split" else 5000,
    }
    log = JetStreamLog(nc, **options)
    await log.ensure()

    async def plant_jetstream(session_id: str, data: bytes) -> None:
        await nc.jetstream().publish(log.subject(session_id), data)

    try:
        yield LogUnderTest(log, lambda: JetStreamLog(nc, **options), plant_jetstream)
    finally:
        await nc.jetstream().delete_stream(f"T_{tag}")
        await nc.close()


@pytest.fixture
def log(subject_log: LogUnderTest) -> Log:
    return subject_log.log


pytestmark = pytest.mark.anyio


async def test_an_unknown_session_is_empty(log: Log) -> None:
    session = new_session()
    assert await log.read(session) == []
    assert await log.read_raw(session) == []
    assert await log.last_index(session) == -1
    assert await log.list_sessions() == []


async def test_appended_events_read_back_in_order(log: Log) -> None:
    session = new_session()
    first, step = events(session, 0, 1), events(session, 1, 10)
    await log.append(session, first)
    await log.append(session, step)
    await log.append(session, [])
    assert await log.read(session) == first + step
    assert await log.last_index(session) == 10
    raw = await log.read_raw(session)
    assert [index for index, _ in raw] == list(range(11))


async def test_a_long_step_is_stored_whole_and_in_order(log: Log) -> None:
    session = new_session()
    await log.append(session, events(session, 0, 1))
    await log.append(session, events(session, 1, 300))
    await log.append(session, events(session, 301, 40))
    assert await log.read(session) == events(session, 0, 341)
    await log.append(session, events(session, 250, 100))  # a retry overlapping the end
    assert await log.read(session, after=300) == events(session, 301, 49)


async def test_read_after_returns_only_later_events(log: Log) -> None:
    session = new_session()
    written = events(session, 0, 40)
    for start in range(0, 40, 8):
        await log.append(session, written[start : start + 8])
    # Another session in between, so stream sequences and indexes differ.
    other = new_session()
    await log.append(other, events(other, 0, 5))
    await log.append(session, events(session, 40, 3))
    written += events(session, 40, 3)
    for after in (-1, 0, 1, 7, 8, 20, 39, 41):
        assert await log.read(session, after=after) == written[after + 1 :], after
    assert await log.read(session, after=42) == []
    assert await log.read(session, after=100) == []
    assert [index for index, _ in await log.read_raw(session, after=30)] == list(range(31, 43))


async def test_a_fresh_handle_reads_what_another_wrote(subject_log: LogUnderTest) -> None:
    session = new_session()
    await subject_log.log.append(session, events(session, 0, 6))
    reader = subject_log.second_writer()
    assert await reader.read(session, after=2) == events(session, 3, 3)
    assert await reader.last_index(session) == 5


async def test_an_append_that_leaves_a_gap_is_refused(log: Log) -> None:
    session = new_session()
    with pytest.raises(AppendConflict, match="does not continue"):
        await log.append(session, events(session, 1, 2))
    await log.append(session, events(session, 0, 2))
    with pytest.raises(AppendConflict, match="does not continue"):
        await log.append(session, events(session, 3, 1))
    assert await log.read(session) == events(session, 0, 2)


async def test_another_writers_event_at_our_index_is_a_conflict(subject_log: LogUnderTest) -> None:
    session = new_session()
    ours, theirs = subject_log.log, subject_log.second_writer()
    await ours.append(session, events(session, 0, 3))
    await theirs.append(session, events(session, 3, 2, tag="theirs"))
    with pytest.raises(AppendConflict, match=f"{session} index 3"):
        await ours.append(session, events(session, 3, 2, tag="ours"))
    assert await ours.read(session) == events(session, 0, 3) + events(session, 3, 2, tag="theirs")


async def test_a_retried_append_neither_duplicates_nor_loses(subject_log: LogUnderTest) -> None:
    session = new_session()
    ours, other_handle = subject_log.log, subject_log.second_writer()
    await ours.append(session, events(session, 0, 3))
    # The same step lands through another handle (as if our first try was stored but unacked);
    # our handle still believes the log ends at index 2.
    await other_handle.append(session, events(session, 3, 4))
    await ours.append(session, events(session, 3, 4))
    assert await ours.read(session) == events(session, 0, 7)
    # A retry that overlaps what is stored and carries one new event appends only the new one.
    await ours.append(session, events(session, 5, 3))
    await ours.append(session, events(session, 0, 8))
    assert await ours.read(session) == events(session, 0, 8)
    assert await ours.last_index(session) == 7


async def test_a_retry_with_other_events_at_stored_indexes_is_a_conflict(log: Log) -> None:
    session = new_session()
    await log.append(session, events(session, 0, 4))
    with pytest.raises(AppendConflict):
        await log.append(session, events(session, 2, 3, tag="late"))
    assert await log.read(session) == events(session, 0, 4)


async def test_bad_batches_are_caller_errors(log: Log) -> None:
    session = new_session()
    with pytest.raises(ValueError, match="belongs to session"):
        await log.append(session, events("someone-else", 0, 1))
    with pytest.raises(ValueError, match="consecutive"):
        await log.append(session, events(session, 0, 1) + events(session, 2, 1))
    with pytest.raises(ValueError, match="invalid session id"):
        await log.append("a.b", events("a.b", 0, 1))
    with pytest.raises(PayloadTooLarge):
        await log.append(session, events(session, 0, 1, size=2 * 1024 * 1024))
    assert await log.read(session) == []


async def test_an_undecodable_entry_fails_the_read_naming_session_and_index(
    subject_log: LogUnderTest,
) -> None:
    session = new_session()
    await subject_log.log.append(session, events(session, 0, 2))
    await subject_log.plant(session, b"\xc1 not msgpack")
    with pytest.raises(MalformedEnvelope) as caught:
        await subject_log.log.read(session)
    assert caught.value.session_id == session
    assert caught.value.index == 2
    # The raw read still hands the bytes over, for operators.
    assert (await subject_log.log.read_raw(session))[-1] == (2, b"\xc1 not msgpack")


async def test_list_sessions_names_every_session_with_entries(log: Log) -> None:
    sessions = sorted(new_session() for _ in range(7))
    for number, session in enumerate(sessions):
        await log.append(session, events(session, 0, number + 1))
    assert sorted(await log.list_sessions()) == sessions


async def test_a_deleted_session_is_gone(log: Log) -> None:
    keep, drop = new_session(), new_session()
    await log.append(keep, events(keep, 0, 2))
    await log.append(drop, events(drop, 0, 2))
    await log.delete_session(drop)  # type: ignore[union-attr]
    assert await log.read(drop) == []
    assert await log.last_index(drop) == -1
    assert await log.list_sessions() == [keep]


async def _collect(log: Log, session: str, after: int, count: int) -> list[Envelope]:
    seen: list[Envelope] = []
    with anyio.fail_after(10):
        async with aclosing(log.tail(session, after)) as stream:  # type: ignore[type-var]
            async for envelope in stream:
                seen.append(envelope)
                if len(seen) == count:
                    break
    return seen


async def test_tail_yields_history_then_live_events_without_gaps_or_repeats(log: Log) -> None:
    session = new_session()
    await log.append(session, events(session, 0, 3))
    seen: list[Envelope] = []

    async def follow() -> None:
        seen.extend(await _collect(log, session, -1, 9))

    async with anyio.create_task_group() as group:
        group.start_soon(follow)
        for start in range(3, 9, 2):
            await anyio.sleep(0.01)
            await log.append(session, events(session, start, 2))
    assert seen == events(session, 0, 9)


async def test_tail_after_an_index_starts_just_past_it(log: Log) -> None:
    session = new_session()
    await log.append(session, events(session, 0, 20))
    assert await _collect(log, session, 12, 7) == events(session, 13, 7)
    later: list[Envelope] = []

    async def follow() -> None:
        later.extend(await _collect(log, session, 19, 2))

    async with anyio.create_task_group() as group:
        group.start_soon(follow)
        await anyio.sleep(0.05)
        await log.append(session, events(session, 20, 2))
    assert later == events(session, 20, 2)


async def test_tail_of_a_session_that_does_not_exist_yet_waits_for_it(log: Log) -> None:
    session = new_session()
    seen: list[Envelope] = []

    async def follow() -> None:
        seen.extend(await _collect(log, session, -1, 3))

    async with anyio.create_task_group() as group:
        group.start_soon(follow)
        await anyio.sleep(0.05)
        await log.append(session, events(session, 0, 3))
    assert seen == events(session, 0, 3)
