"""The daemon's cache of folded sessions (``apomesh.runtime.folds.FoldCache``) over the JetStream
log on a real nats-server: a session is folded whole once, then only what was appended since; an
ended one is answered without reading the log; broken or unknown sessions are never kept."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from tests.golden.make_golden import fanout_resumed, solo_completed

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.nats_connect import NATS, connect
from apomesh.core import envelope
from apomesh.core.envelope import Envelope
from apomesh.core.errors import IndexGap, NotFound
from apomesh.core.events import Event
from apomesh.core.state import fold
from apomesh.core.views import session_view
from apomesh.runtime.folds import FoldCache

pytestmark = pytest.mark.anyio


@pytest.fixture
async def log(nats_url: str) -> AsyncIterator[JetStreamLog]:
    nc: NATS = await connect(nats_url)
    made = JetStreamLog(nc)
    await made.ensure()
    yield made
    await nc.close()


def envelopes(session_id: str, events: list[Event], start: int = 0) -> list[Envelope]:
    return [
        envelope.make(session_id, start + i, 1_767_225_600.0 + i, uuid.uuid4().hex, event)
        for i, event in enumerate(events)
    ]


class CountingRead:
    def __init__(self, log: JetStreamLog) -> None:
        self.log = log
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, session_id: str, after: int) -> list[Envelope]:
        self.calls.append((session_id, after))
        return await self.log.read(session_id, after)


async def test_a_growing_session_is_folded_once_then_incrementally(log: JetStreamLog) -> None:
    session_id = uuid.uuid4().hex
    events = fanout_resumed()
    everything = envelopes(session_id, events)
    read = CountingRead(log)
    cache = FoldCache(read)
    await log.append(session_id, everything[:5])
    first = await cache.view(session_id)
    assert first.last_index == 4 and cache.full_folds == 1
    assert await cache.view(session_id) is first  # nothing new: the same view
    await log.append(session_id, everything[5:12])
    await log.append(session_id, everything[12:])
    state = await cache.state(session_id)
    assert cache.full_folds == 1 and cache.incremental_folds == 1
    assert read.calls[-1] == (session_id, 4)
    assert session_view(state) == session_view(fold(everything, session_id))
    assert state.terminal
    calls = len(read.calls)
    ended = await cache.view(session_id)
    assert ended.status == "completed" and ended.last_index == len(events) - 1
    assert len(read.calls) == calls  # an ended session is not read again


async def test_unknown_and_broken_sessions_are_not_kept(log: JetStreamLog) -> None:
    cache = FoldCache(log.read)
    with pytest.raises(NotFound):
        await cache.state(uuid.uuid4().hex)
    assert len(cache) == 0
    session_id = uuid.uuid4().hex
    events = solo_completed()
    await log.append(session_id, envelopes(session_id, events[:3]))
    assert (await cache.state(session_id)).last_index == 2
    # Another writer's events arrive that skip an index: the kept state is dropped, not patched.
    broken = envelopes(session_id, events[3:5], start=3)

    async def gap_read(sid: str, after: int) -> list[Envelope]:
        return broken[1:] if after >= 0 else await log.read(sid, after)

    cache._read = gap_read
    with pytest.raises(IndexGap):
        await cache.state(session_id)
    assert len(cache) == 0


async def test_the_least_recently_used_sessions_are_let_go(log: JetStreamLog) -> None:
    cache = FoldCache(log.read, capacity=2)
    ids = [uuid.uuid4().hex for _ in range(3)]
    for session_id in ids:
        await log.append(session_id, envelopes(session_id, solo_completed()))
        await cache.view(session_id)
    assert len(cache) == 2
    await cache.view(ids[0])
    assert cache.full_folds == 4


async def test_an_ended_sessions_final_state_kept_from_its_writer_needs_no_read(
    log: JetStreamLog,
) -> None:
    """The state a writer ends with is kept as is: the session is answered with no log read
    (so while NATS is out of reach too); a state that has not ended is not taken."""
    session_id = uuid.uuid4().hex
    events = solo_completed()
    final = fold(envelopes(session_id, events), session_id)
    read = CountingRead(log)
    cache = FoldCache(read)
    with pytest.raises(ValueError, match="has not ended"):
        cache.keep_ended(fold(envelopes(session_id, events[:-1]), session_id))
    cache.keep_ended(final)
    assert (await cache.view(session_id)).status == "completed"
    assert await cache.state(session_id) is final
    assert read.calls == [] and cache.full_folds == 0
