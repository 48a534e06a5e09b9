"""The daemon's writes of changed sessions' fold checkpoints (``FoldCheckpoints.write_changed``):
every session that appended since is written, ``WRITTEN_TOGETHER`` to a store write; the shape
left out is stored once; a failed write gives its sessions, and those not written yet, back for
the next one (a store out of reach is not waited for once per group). On the
in-memory store (the LMDB store's contract; the real one runs in the integration and e2e tests)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from tests.e2e.chaos_kit import shape_of, stored_session, thinker

from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.adapters.memory_store import MemoryStore
from apomesh.core.errors import StoreError
from apomesh.core.events import SessionShape
from apomesh.core.state import fold
from apomesh.core.state_codec import FoldCheckpoint, make_checkpoint, shape_key
from apomesh.runtime import fold_checkpoints
from apomesh.runtime.fold_checkpoints import CHECKPOINT_DB, SHAPES_DB, FoldCheckpoints

pytestmark = pytest.mark.anyio

SHAPE = shape_of(thinker(2))


class Writer:
    """A session's writer as ``keep_current`` sees it: its state at its last append."""

    def __init__(self) -> None:
        envelopes = stored_session(uuid.uuid4().hex, SHAPE, events=6)
        self.session_id = envelopes[0].session_id
        self.state = fold(envelopes)
        self.event_id = envelopes[-1].event_id
        self.lost = 0

    def current_checkpoint(self) -> tuple[FoldCheckpoint, SessionShape | None]:
        checkpoint = make_checkpoint(
            self.state, self.event_id, 3, messages=3, log_id="L", shape=shape_key(SHAPE)
        )
        return checkpoint, SHAPE

    def checkpoint_lost(self) -> None:
        self.lost += 1


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[int] = []
        self.failing = False

    def write_batch(self, puts: Sequence[Any], deletes: Sequence[Any] = ()) -> None:
        if self.failing:
            raise StoreError("the disk is full")
        self.writes.append(len(puts))
        super().write_batch(puts, deletes)


async def test_every_changed_session_is_written_a_thousand_to_a_store_write() -> None:
    store = CountingStore()
    checkpoints = FoldCheckpoints(AsyncStore(store))
    writers = [Writer() for _ in range(fold_checkpoints.WRITTEN_TOGETHER * 2 + 5)]
    for writer in writers:
        checkpoints.changed(writer)
        checkpoints.changed(writer)  # noted twice, written once
    assert await checkpoints.write_changed() == len(writers)
    # The shape goes with the first write only; each write holds at most a thousand sessions.
    assert store.writes == [
        fold_checkpoints.WRITTEN_TOGETHER + 1,
        fold_checkpoints.WRITTEN_TOGETHER,
        5,
    ]
    assert len(store.scan(SHAPES_DB, "")) == 1
    assert len(store.scan(CHECKPOINT_DB, "")) == len(writers)
    assert await checkpoints.write_changed() == 0  # nothing changed since
    loaded = await FoldCheckpoints(AsyncStore(store)).load_all()
    assert {s: p.state for s, p in loaded.items()} == {w.session_id: w.state for w in writers}


async def test_a_failed_write_gives_its_sessions_and_the_rest_back_for_the_next() -> None:
    store = CountingStore()
    checkpoints = FoldCheckpoints(AsyncStore(store))
    writers = [Writer() for _ in range(fold_checkpoints.WRITTEN_TOGETHER + 1)]
    for writer in writers:
        checkpoints.changed(writer)
    store.failing = True
    assert await checkpoints.write_changed() == 0
    assert [w.lost for w in writers] == [1] * len(writers)  # one try, not one per group
    store.failing = False
    assert await checkpoints.write_changed() == len(writers)
    writer = writers[0]
    assert store.get(SHAPES_DB, shape_key(SHAPE)) is not None  # the shape too, once it landed
    checkpoints.forget(writer.session_id)
