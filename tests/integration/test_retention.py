"""The retention sweep (``runtime.retention``) on a real nats-server and a real LMDB store, alone
and written through to the replicated bucket: more ended sessions than one group of purges, each
removed from the log stream and from every store database, and a session that ended after the
cutoff left whole. And the completed records the boot scan writes for the ended sessions it
finds, more than one atomic batch of the bucket holds."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from tests.e2e.chaos_kit import shape_of, stored_session, thinker

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore
from apomesh.adapters.nats_connect import NATS, connect
from apomesh.adapters.natsserver import NatsServer
from apomesh.adapters.replicated_store import ReplicatedStore
from apomesh.core.errors import LogUnavailable
from apomesh.core.state import fold
from apomesh.runtime.fold_checkpoints import CHECKPOINT_DB
from apomesh.runtime.registry import IDEMPOTENCY_DB, IdempotencyRecord, SessionRegistry
from apomesh.runtime.retention import PURGE_TOGETHER, SESSION_DATABASES, Retention

pytestmark = pytest.mark.anyio

OLD_TS = 1_700_000_000.0
CUTOFF = 1_700_000_500.0


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    client = await connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture(params=["lmdb", "replicated"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, nats_server: NatsServer
) -> AsyncIterator[AsyncStore]:
    """LMDB alone, and LMDB written through to the replicated bucket, whose every write is one
    JetStream atomic batch of at most 1,000 messages (more than one group's deletes)."""
    local = LmdbStore(tmp_path / "lmdb")
    if request.param == "lmdb":
        opened = AsyncStore(local)
    else:
        opened = AsyncStore(await ReplicatedStore.open(local, [nats_server.url]))
    async with opened:
        yield opened


async def ended(log: JetStreamLog, registry: SessionRegistry, ts: float) -> str:
    """An ended session on the log with its completed record, ending at ``ts``."""
    session_id = uuid.uuid4().hex
    envelopes = stored_session(
        session_id, shape_of(thinker(2)), goal="old", events=6, terminal=True, ts=ts
    )
    await log.append(session_id, envelopes)
    await registry.write_completed_many([fold(envelopes, session_id)])
    return session_id


def records_of(session_id: str) -> list[tuple[str, str, bytes]]:
    """The store records a session's agents leave: one per session database, its fold
    checkpoint, and an ``Idempotency-Key`` answering it."""
    request = msgspec.msgpack.encode(IdempotencyRecord(session_id, "sha"))
    return [
        *((db, f"{session_id}/root/1", b"record") for db in SESSION_DATABASES),
        (CHECKPOINT_DB, session_id, b"checkpoint"),
        (IDEMPOTENCY_DB, f"key-{session_id}", request),
    ]


async def log_and_registry(nc: NATS, store: AsyncStore) -> tuple[JetStreamLog, SessionRegistry]:
    """The log and the registry a daemon's retention works with (the registry's completed
    records in ``store``; no lease or snapshot is touched by a purge)."""
    log = JetStreamLog(nc)
    await log.ensure()
    registry = SessionRegistry(
        log_adapter=log,
        leases=cast(Any, None),
        store=store,
        snapshots=cast(Any, None),
        spawn=asyncio.ensure_future,
    )
    return log, registry


async def test_a_sweep_purges_many_ended_sessions_in_groups_and_keeps_the_recent(
    nc: NATS, store: AsyncStore, caplog: pytest.LogCaptureFixture
) -> None:
    log, registry = await log_and_registry(nc, store)
    forgotten: list[str] = []
    retention = Retention(
        log_adapter=log,
        store=store,
        registry=registry,
        forget=forgotten.append,
        progress_every=0,  # a progress line after every group
    )
    old = [await ended(log, registry, OLD_TS) for _ in range(PURGE_TOGETHER + 44)]
    recent = await ended(log, registry, CUTOFF + 100)
    for session_id in [*old, recent]:
        await store.write_batch(records_of(session_id))

    with caplog.at_level(logging.INFO, logger="apomesh.daemon"):
        purged = await retention.sweep(CUTOFF)

    # What the daemon says meanwhile: how many, how far after each group, done; no line a session.
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said[0] == f"retention: purging {len(purged):,} sessions that ended past retention"
    steps = [
        re.fullmatch(r"retention: ([\d,]+) of ([\d,]+) sessions purged \((\d+)%\)", m)
        for m in said[1:-1]
    ]
    assert len(steps) >= 2 and all(steps), said
    assert steps[-1] is not None and steps[-1].group(3) == "100"
    assert said[-1] == f"retention: {len(purged):,} ended sessions purged"

    assert sorted(purged) == sorted(old) and sorted(forgotten) == sorted(old)
    on_the_log = set(await log.list_sessions())  # the server may hold other tests' sessions
    assert recent in on_the_log and not on_the_log & set(old)
    mine = {*old, recent}  # the replicated bucket may hold other tests' records
    completed = {r.session_id for r in await registry.completed_records()}
    assert completed & mine == {recent}
    for db in (*SESSION_DATABASES, CHECKPOINT_DB, IDEMPOTENCY_DB):
        left = [key for key, _ in await store.scan(db, "") if any(s in key for s in mine)]
        assert len(left) == 1 and recent in left[0], (db, len(left))
    assert await retention.sweep(CUTOFF) == []  # nothing left to purge: a no-op


async def test_a_session_whose_log_is_not_purged_keeps_its_records_and_the_rest_go_on(
    nc: NATS, store: AsyncStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NATS does not purge one session's log subject: that session keeps every record (still
    listed as ended, for the next sweep), every other is purged, and the error is raised."""
    log, registry = await log_and_registry(nc, store)
    retention = Retention(log_adapter=log, store=store, registry=registry)
    old = [await ended(log, registry, OLD_TS) for _ in range(5)]
    for session_id in old:
        await store.write_batch(records_of(session_id))
    stuck = old[2]
    purge = log.delete_session

    async def refusing(session_id: str) -> None:
        if session_id == stuck:
            raise LogUnavailable(f"delete session {session_id}: no answer")
        await purge(session_id)

    monkeypatch.setattr(log, "delete_session", refusing)
    with pytest.raises(LogUnavailable):
        await retention.sweep(CUTOFF)

    on_the_log = set(await log.list_sessions())
    assert stuck in on_the_log and not on_the_log & (set(old) - {stuck})
    completed = {r.session_id for r in await registry.completed_records()}
    assert completed & set(old) == {stuck}  # the bucket may hold other tests' records
    for db in SESSION_DATABASES:
        left = [key for key, _ in await store.scan(db, "") if any(s in key for s in old)]
        assert left == [f"{stuck}/root/1"]
    monkeypatch.setattr(log, "delete_session", purge)
    assert await retention.sweep(CUTOFF) == [stuck]  # the next sweep finishes the job


async def test_the_boot_scan_books_more_ended_sessions_than_one_atomic_batch_holds(
    nc: NATS, store: AsyncStore
) -> None:
    """``write_completed_many`` with 1,100 ended sessions (the replicated bucket takes at most
    1,000 messages in one atomic batch; one write of them all was refused and stopped the
    daemon's start): every record is written."""
    _, registry = await log_and_registry(nc, store)
    shape = shape_of(thinker(2))
    states = []
    for _ in range(1_100):
        session_id = uuid.uuid4().hex
        envelopes = stored_session(
            session_id, shape, goal="old", events=6, terminal=True, ts=OLD_TS
        )
        states.append(fold(envelopes, session_id))

    await registry.write_completed_many(states)

    written = {r.session_id for r in await registry.completed_records()}
    assert {state.session_id for state in states} <= written
