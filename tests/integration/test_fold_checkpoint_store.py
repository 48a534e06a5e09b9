"""Fold checkpoints (``runtime.fold_checkpoints``) on a real nats-server and a real LMDB store.

A session's writer stores the state it folded, at an index the log has, with that envelope's id,
and drops it when the session ends. Folding a session from its checkpoint, one by one
(``FoldCheckpoints.fold``) and in the boot scan's one pass (``JetStreamLog.fold_all``), reads only
the envelopes after it; a checkpoint the log contradicts (the session purged and its id reused) is
ignored, and the session folds from its first event to exactly the new log's state."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from tests.e2e.chaos_kit import shape_of, stored_session, thinker
from tests.strategies import born, session_started
from tests.writers import writer_deps

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore
from apomesh.adapters.memory_log import MemoryLog
from apomesh.adapters.nats_connect import NATS, connect
from apomesh.adapters.natsserver import NatsServer
from apomesh.core import envelope
from apomesh.core.envelope import Envelope
from apomesh.core.events import HitlPaused, SessionEnded
from apomesh.core.state import fold, new_state
from apomesh.core.state_codec import decode_checkpoint, make_checkpoint
from apomesh.runtime.fold_checkpoints import CHECKPOINT_DB, FoldCheckpoints
from apomesh.runtime.folds import FoldCache
from apomesh.runtime.sessions import SessionRuntime

pytestmark = pytest.mark.anyio

EVENTS = 60
AT = 39
"""The checkpoint's index: 20 envelopes follow it."""


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    client = await connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture
async def checkpoints(tmp_path: Path) -> AsyncIterator[FoldCheckpoints]:
    store = AsyncStore(LmdbStore(tmp_path / "lmdb"))
    yield FoldCheckpoints(store)
    await store.aclose()


def a_session(goal: str = "long", session_id: str | None = None) -> list[Envelope]:
    return stored_session(
        session_id or uuid.uuid4().hex, shape_of(thinker(2)), goal=goal, events=EVENTS
    )


async def logged(log: JetStreamLog, envelopes: list[Envelope]) -> None:
    """Append the session two events at a time, as a step's appends are (a message each)."""
    for first in range(0, len(envelopes), 2):
        await log.append(envelopes[0].session_id, envelopes[first : first + 2])


async def checkpointed(
    checkpoints: FoldCheckpoints, envelopes: list[Envelope], seq: int | None
) -> None:
    """Store the checkpoint the session's writer would have stored at ``AT``."""
    state = fold(envelopes[: AT + 1])
    await checkpoints.write(make_checkpoint(state, envelopes[AT].event_id, seq))


async def sequence_of(log: JetStreamLog, session_id: str, index: int) -> int:
    """The stream sequence of the message holding the session's event ``index``."""
    seq = await log._start_seq_after(session_id, index - 1, time.monotonic() + 10)
    assert seq is not None
    return seq


async def checkpointed_on_jetstream(
    nc: NATS, checkpoints: FoldCheckpoints
) -> tuple[JetStreamLog, list[Envelope]]:
    """A session logged on JetStream, with the checkpoint its writer would have stored at ``AT``
    (its stream sequence included)."""
    log = JetStreamLog(nc)
    await log.ensure()
    envelopes = a_session()
    await logged(log, envelopes)
    await checkpointed(checkpoints, envelopes, await sequence_of(log, envelopes[0].session_id, AT))
    return log, envelopes


async def reuse(nc: NATS, log: JetStreamLog, session_id: str) -> list[Envelope]:
    """Purge the session and store another log under its id (plain publishes: its message ids
    are still in the duplicate window)."""
    await log.delete_session(session_id)
    other = a_session("another", session_id)
    for env in other:
        await nc.publish(log.subject(session_id), envelope.encode(env))
    await nc.flush()
    with anyio.fail_after(10):
        while await log.last_index(session_id) < EVENTS - 1:
            await anyio.sleep(0.02)
    log.forget_position(session_id)
    return other


async def test_one_session_folds_from_its_checkpoint_reading_only_the_tail(
    nc: NATS, checkpoints: FoldCheckpoints
) -> None:
    _, envelopes = await checkpointed_on_jetstream(nc, checkpoints)
    session_id = envelopes[0].session_id

    state = await checkpoints.fold(JetStreamLog(nc), session_id)  # a fresh log knows no position
    assert state == fold(envelopes)
    assert (checkpoints.stats.used, checkpoints.stats.events_after) == (1, EVENTS - 1 - AT)
    assert checkpoints.stats.events_whole == 0


async def test_a_checkpoint_without_a_sequence_is_read_from_its_index(
    checkpoints: FoldCheckpoints,
) -> None:
    log = MemoryLog()
    envelopes = a_session()
    await log.append(envelopes[0].session_id, envelopes)
    await checkpointed(checkpoints, envelopes, None)

    assert await checkpoints.fold(log, envelopes[0].session_id) == fold(envelopes)
    assert (checkpoints.stats.used, checkpoints.stats.events_after) == (1, EVENTS - 1 - AT)


async def test_the_fold_cache_starts_a_session_from_its_checkpoint(
    nc: NATS, checkpoints: FoldCheckpoints
) -> None:
    log, envelopes = await checkpointed_on_jetstream(nc, checkpoints)
    session_id = envelopes[0].session_id
    cache = FoldCache(log.read, start=lambda sid: checkpoints.fold(log, sid))

    assert await cache.state(session_id) == fold(envelopes)
    assert (checkpoints.stats.used, checkpoints.stats.events_after) == (1, EVENTS - 1 - AT)
    assert cache.full_folds == 1


async def test_a_purged_and_reused_session_folds_from_its_start(
    nc: NATS, checkpoints: FoldCheckpoints
) -> None:
    log, envelopes = await checkpointed_on_jetstream(nc, checkpoints)
    session_id = envelopes[0].session_id
    other = await reuse(nc, log, session_id)

    state = await checkpoints.fold(JetStreamLog(nc), session_id)
    assert state == fold(other)
    assert state.goal == "another"
    assert (checkpoints.stats.used, checkpoints.stats.ignored) == (0, 1)
    assert checkpoints.stats.events_whole == EVENTS


async def test_the_one_pass_starts_at_the_checkpoint_and_drops_a_contradicted_one(
    nc: NATS, checkpoints: FoldCheckpoints
) -> None:
    log = JetStreamLog(
        nc, stream=f"LOG_{uuid.uuid4().hex[:8]}", subject_prefix=f"p{uuid.uuid4().hex[:8]}"
    )
    await log.ensure()
    kept, reused = a_session("kept"), a_session("reused")
    for envelopes in (kept, reused):
        await logged(log, envelopes)
        session_id = envelopes[0].session_id
        await log.read(session_id)
        seq = (log.known_end(session_id, EVENTS - 1) or (None,))[0]
        assert seq is not None
        await checkpointed(checkpoints, envelopes, seq - (EVENTS - 1 - AT))
    other = await reuse(nc, log, reused[0].session_id)
    sessions = [kept[0].session_id, reused[0].session_id]

    folded = await log.fold_all(set(), resume=await checkpoints.load_all(), sessions=sessions)
    assert folded.states[kept[0].session_id] == fold(kept)
    assert folded.resumed == {kept[0].session_id}
    assert folded.stale == folded.suspect == {reused[0].session_id}
    # The pass began at the kept checkpoint's event: nothing of the kept session before it was
    # folded, and the reused one is left to be read one by one.
    assert folded.folded == EVENTS - 1 - AT
    assert await checkpoints.fold(log, reused[0].session_id) == fold(other)


async def test_a_checkpoint_of_another_fold_format_is_ignored(
    nc: NATS, checkpoints: FoldCheckpoints
) -> None:
    log = JetStreamLog(nc)
    await log.ensure()
    envelopes = a_session()
    session_id = envelopes[0].session_id
    await logged(log, envelopes)
    checkpoint = make_checkpoint(fold(envelopes[: AT + 1]), envelopes[AT].event_id)
    await checkpoints.write(
        msgspec.structs.replace(checkpoint, fold_format=checkpoint.fold_format + 1)
    )

    assert await checkpoints.fold(log, session_id) == fold(envelopes)
    assert (checkpoints.stats.used, checkpoints.stats.ignored) == (0, 1)


async def stored_record(checkpoints: FoldCheckpoints, session_id: str, gone: bool = False) -> Any:
    """The session's checkpoint record once the writer's task stored it (or removed it)."""
    with anyio.fail_after(10):
        while True:
            raw = await checkpoints.store.get(CHECKPOINT_DB, session_id)
            if (raw is None) == gone:
                return None if raw is None else decode_checkpoint(raw)
            await anyio.sleep(0.01)


async def test_the_writer_stores_what_the_log_has_and_drops_it_at_the_end(
    tmp_path: Path, checkpoints: FoldCheckpoints
) -> None:
    log = MemoryLog()
    deps = writer_deps(
        tmp_path, log=log, store=checkpoints.store, checkpoints=checkpoints, checkpoint_every=3
    )
    runtime = SessionRuntime(deps, new_state("s-writes"))
    await runtime.append(session_started(), born("root"))
    assert await checkpoints.store.get(CHECKPOINT_DB, "s-writes") is None  # 2 events: not yet
    await runtime.append(HitlPaused("root", "p1", "go?"))

    checkpoint = await stored_record(checkpoints, "s-writes")
    logged = await log.read("s-writes")
    assert checkpoint.index == 2 and checkpoint.seq is None  # the memory log has no sequences
    assert checkpoint.event_id == logged[2].event_id
    assert checkpoint.bootstrap is not None  # its shape is stored once, beside it
    point = await checkpoints.load("s-writes")
    assert point is not None and point.state == fold(logged[:3])

    await runtime.answer_hitl("p1", "yes", by="op")
    await runtime.append(SessionEnded(status="completed", output="done"))
    await stored_record(checkpoints, "s-writes", gone=True)
