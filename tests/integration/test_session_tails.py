"""Shared live tails (``apomesh.runtime.tails.SessionTails``) over the JetStream log on a real
nats-server: readers joining at any point get every event after their position exactly once and
in order while one log tail serves them all; a reader that falls too far behind is ended (to
reconnect) without disturbing the others; the tail goes away with its last reader."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import anyio
import pytest
from tests.golden.make_golden import fanout_resumed

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.nats_connect import NATS, connect
from apomesh.core import envelope
from apomesh.core.envelope import Envelope
from apomesh.core.errors import LogUnavailable
from apomesh.core.events import Event
from apomesh.runtime.tails import SessionTails

pytestmark = pytest.mark.anyio


@pytest.fixture
async def log(nats_url: str) -> AsyncIterator[JetStreamLog]:
    nc: NATS = await connect(nats_url)
    made = JetStreamLog(nc)
    await made.ensure()
    yield made
    await nc.close()


def envelopes(session_id: str, events: list[Event]) -> list[Envelope]:
    return [
        envelope.make(session_id, i, 1_767_225_600.0 + i, uuid.uuid4().hex, event)
        for i, event in enumerate(events)
    ]


async def test_readers_joining_anywhere_see_every_event_once_through_one_tail(
    log: JetStreamLog,
) -> None:
    session_id = uuid.uuid4().hex
    everything = envelopes(session_id, fanout_resumed())
    last = everything[-1].index
    await log.append(session_id, everything[:3])
    tails = SessionTails(log)
    seen: dict[str, list[int]] = {}
    feeds_seen: set[int] = set()

    async def reader(name: str, after: int) -> None:
        indexes = seen.setdefault(name, [])
        async for env in tails.follow(session_id, after):
            indexes.append(env.index)
            if env.index < last:  # the tail ends with the terminal event
                feeds_seen.add(len(tails))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            for i in range(10):
                group.start_soon(reader, f"early-{i}", -1 if i % 2 else 1)
            for position, env in enumerate(everything[3:], start=3):
                await log.append(session_id, [env])
                if position % 4 == 0:
                    group.start_soon(reader, f"late-{position}", position - 2)
                await anyio.sleep(0.005)
    for name, indexes in seen.items():
        after = -1 if name.startswith("early") and int(name.split("-")[1]) % 2 else 1
        if name.startswith("late"):
            after = int(name.split("-")[1]) - 2
        assert indexes == list(range(after + 1, last + 1)), name
    # One shared log tail the whole time: never two. (A slow reader may still be draining its
    # queue after the tail saw the terminal event and ended: it then counts none.)
    assert max(feeds_seen) == 1, feeds_seen
    assert len(tails) == 0  # and none once the session ended


async def test_a_reader_too_far_behind_is_ended_and_the_others_go_on(log: JetStreamLog) -> None:
    session_id = uuid.uuid4().hex
    everything = envelopes(session_id, fanout_resumed())
    await log.append(session_id, everything[:1])
    tails = SessionTails(log, backlog=3)
    stuck = tails.follow(session_id, -1)
    first = await anext(stuck)
    assert first.index == 0
    fast: list[int] = []

    async def keep_up() -> None:
        async for env in tails.follow(session_id, 0):
            fast.append(env.index)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(keep_up)
            while tails.readers(session_id) < 2:
                await anyio.sleep(0.01)
            for env in everything[1:]:
                await log.append(session_id, [env])
                await anyio.sleep(0.005)
    assert fast == list(range(1, len(everything)))
    with pytest.raises(LogUnavailable):
        async for _ in stuck:
            pass


async def test_the_tail_goes_away_with_its_last_reader(log: JetStreamLog) -> None:
    session_id = uuid.uuid4().hex
    everything = envelopes(session_id, fanout_resumed())
    await log.append(session_id, everything[:5])
    tails = SessionTails(log)
    readers = [tails.follow(session_id, -1) for _ in range(3)]
    for stream in readers:
        assert (await anext(stream)).index == 0
    assert len(tails) == 1 and tails.readers(session_id) == 3
    for stream in readers:
        await stream.aclose()
    assert len(tails) == 0
    # A new reader starts a new tail, and sees what was appended meanwhile.
    await log.append(session_id, everything[5:8])
    again = [env.index async for env in _until(tails.follow(session_id, 4), 7)]
    assert again == [5, 6, 7]


async def _until(stream: AsyncIterator[Envelope], index: int) -> AsyncIterator[Envelope]:
    async for env in stream:
        yield env
        if env.index >= index:
            break
    await stream.aclose()  # type: ignore[attr-defined]
