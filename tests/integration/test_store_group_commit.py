"""The async store facade's group commit on real LMDB: writes that queue while a transaction is
being committed go in the next one together, each caller's batch stays all-or-nothing and durable
when its call returns, and one bad batch fails only its own caller."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore
from apomesh.adapters.memory_store import MemoryStore
from apomesh.core.errors import StoreError


class CountingStore(LmdbStore):
    """LMDB that counts its write transactions."""

    transactions = 0

    def write_batch(
        self, puts: Sequence[tuple[str, str, bytes]], deletes: Sequence[tuple[str, str]] = ()
    ) -> None:
        self.transactions += 1
        super().write_batch(puts, deletes)

    def write_batches(
        self, batches: Sequence[tuple[Sequence[tuple[str, str, bytes]], Sequence[tuple[str, str]]]]
    ) -> None:
        self.transactions += 1
        super().write_batches(batches)


@pytest.mark.anyio
async def test_concurrent_writes_share_transactions_and_all_land(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "db")
    facade = AsyncStore(store)

    async def write(i: int) -> None:
        await facade.write_batch([("segments", f"a\x00{i:04d}", b"seg%d" % i)])
        await facade.put_journal("s/a", f"call{i}", b"j%d" % i)
        await facade.put_snapshot("s/a", i + 1, b"snap%d" % i)

    async with anyio.create_task_group() as group:
        for i in range(60):
            group.start_soon(write, i)

    assert len(await facade.scan("segments", "a\x00")) == 60
    assert await facade.get_journal("s/a", "call59") == b"j59"
    assert await facade.latest_snapshot("s/a") == (60, b"snap59")
    assert store.transactions < 3 * 60  # writes that queued together were committed together
    await facade.aclose()
    with LmdbStore(tmp_path / "db") as reopened:  # every acknowledged write is on disk
        assert len(reopened.scan("journal", "s/a")) == 60


@pytest.mark.anyio
async def test_a_bad_batch_in_a_group_fails_only_its_caller(tmp_path: Path) -> None:
    facade = AsyncStore(LmdbStore(tmp_path / "db"))
    outcomes: dict[int, str] = {}

    async def write(i: int) -> None:
        database = "no-such-db" if i == 7 else "segments"
        try:
            await facade.write_batch(
                [(database, f"k{i:02d}", b"v"), ("segments", f"x{i:02d}", b"v")]
            )
            outcomes[i] = "ok"
        except StoreError as exc:
            outcomes[i] = str(exc)

    async with anyio.create_task_group() as group:
        for i in range(20):
            group.start_soon(write, i)

    assert "no-such-db" in outcomes.pop(7)
    assert set(outcomes.values()) == {"ok"}
    stored = [key for key, _ in await facade.scan("segments", "")]
    assert "x07" not in stored  # the bad batch left nothing behind
    assert len(stored) == 2 * 19
    await facade.aclose()


@pytest.mark.anyio
async def test_stores_without_write_batches_are_written_batch_by_batch() -> None:
    facade = AsyncStore(MemoryStore())

    async with anyio.create_task_group() as group:
        for i in range(10):
            group.start_soon(facade.put_journal, "s/a", f"c{i}", b"j")

    assert len(await facade.scan("journal", "s/a")) == 10


@pytest.mark.anyio
async def test_a_caller_cancelled_while_queued_takes_its_write_back(tmp_path: Path) -> None:
    facade = AsyncStore(LmdbStore(tmp_path / "db"))
    entered, release = threading.Event(), threading.Event()
    original = facade._commit_group

    def slow_commit(group: list[Any]) -> None:
        entered.set()
        release.wait(10)
        original(group)

    facade._commit_group = slow_commit  # type: ignore[method-assign]
    async with anyio.create_task_group() as group:
        group.start_soon(facade.put_journal, "s/a", "first", b"1")
        while not entered.is_set():  # the first write is being committed
            await anyio.sleep(0.01)
        with anyio.move_on_after(0.05):
            await facade.put_journal("s/a", "queued", b"2")  # waits behind it, then gives up
        release.set()

    assert await facade.get_journal("s/a", "first") == b"1"
    assert await facade.get_journal("s/a", "queued") is None
    await facade.put_journal("s/a", "after", b"3")  # the queue is not stuck
    assert await facade.get_journal("s/a", "after") == b"3"
    await facade.aclose()


@pytest.mark.anyio
async def test_closing_commits_what_is_queued_first(tmp_path: Path) -> None:
    facade = AsyncStore(LmdbStore(tmp_path / "db"))
    async with anyio.create_task_group() as group:
        for i in range(30):
            group.start_soon(facade.put_journal, "s/a", f"c{i}", b"j")
        await anyio.sleep(0)
    await facade.aclose()
    with LmdbStore(tmp_path / "db") as reopened:
        assert len(reopened.scan("journal", "s/a")) == 30


@pytest.mark.anyio
async def test_a_burst_of_waiting_writes_is_committed_in_one_group() -> None:
    """Writes that queued while a commit ran all go in the next commit: one fsync for the burst,
    taken while the event loop waits for it."""
    import asyncio

    from apomesh.adapters.lmdb_store import _GroupWriter, _QueuedWrite

    first_commit = threading.Event()
    release = threading.Event()
    sizes: list[int] = []

    def commit(group: list[_QueuedWrite]) -> None:
        sizes.append(len(group))
        if len(sizes) == 1:
            first_commit.set()
            release.wait(10)

    loop = asyncio.get_running_loop()
    writer = _GroupWriter(commit)
    entries = [_QueuedWrite([], [], loop.create_future())]
    writer.submit(entries[0])
    await anyio.to_thread.run_sync(first_commit.wait, 10)
    for _ in range(10):  # a burst while the first commit runs
        entries.append(_QueuedWrite([], [], loop.create_future()))
        writer.submit(entries[-1])
    release.set()
    await asyncio.wait_for(asyncio.gather(*(e.future for e in entries)), 10)
    await anyio.to_thread.run_sync(writer.stop)
    assert sizes == [1, 10], sizes
