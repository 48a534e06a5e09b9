"""The ``StateStore`` contract, run on the in-memory twin and on real LMDB in a tmp dir, plus what
only the disk can show: reopening, a full map, and SIGKILL in the middle of writes."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore, snapshot_key
from apomesh.adapters.memory_store import MemoryStore
from apomesh.core.errors import StoreError, StoreFull
from apomesh.core.ports import StateStore

ALICE = "s1/root"
BOB = "s1/root.1"


@pytest.fixture(params=["memory", "lmdb", "replicated"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    made: StateStore
    if request.param == "memory":
        made = MemoryStore()
    elif request.param == "lmdb":
        made = LmdbStore(tmp_path / "db")
    else:  # LMDB and the replicated bucket on a real nats-server, emptied for each test
        from tests.store_support import empty_replicated_store

        made = empty_replicated_store(request.getfixturevalue("nats_url"), tmp_path / "db")
    yield made
    made.close()


# -- snapshots --------------------------------------------------------------------------------------


def test_a_snapshot_reads_back_by_agent_and_id(store: StateStore) -> None:
    store.put_snapshot(ALICE, 1, b"one")
    store.put_snapshot(ALICE, 2, b"two")
    store.put_snapshot(BOB, 1, b"bob")
    assert store.get_snapshot(ALICE, 1) == b"one"
    assert store.get_snapshot(ALICE, 2) == b"two"
    assert store.get_snapshot(BOB, 1) == b"bob"
    assert store.get_snapshot(ALICE, 3) is None
    assert store.get_snapshot("s1/nobody", 1) is None


def test_rewriting_a_snapshot_keeps_the_last_value(store: StateStore) -> None:
    store.put_snapshot(ALICE, 7, b"first")
    store.put_snapshot(ALICE, 7, b"second")
    assert store.get_snapshot(ALICE, 7) == b"second"


def test_latest_snapshot_is_the_highest_id_not_the_last_written(store: StateStore) -> None:
    assert store.latest_snapshot(ALICE) is None
    for snapshot_id in (256, 2, 10, 255, 15):
        store.put_snapshot(ALICE, snapshot_id, f"v{snapshot_id}".encode())
    assert store.latest_snapshot(ALICE) == (256, b"v256")


def test_latest_snapshot_ignores_agents_whose_key_extends_this_one(store: StateStore) -> None:
    # "s1/root.1" and "s1/root/x" start with "s1/root": the layout must keep them apart.
    store.put_snapshot(ALICE, 3, b"alice")
    store.put_snapshot(BOB, 9, b"bob")
    store.put_snapshot(ALICE + "/x", 99, b"nested")
    store.put_snapshot("s1/roo", 50, b"shorter")
    assert store.latest_snapshot(ALICE) == (3, b"alice")
    assert store.latest_snapshot(BOB) == (9, b"bob")
    assert store.latest_snapshot("s1/roo") == (50, b"shorter")
    assert store.latest_snapshot("s1/r") is None


def test_the_largest_snapshot_id_still_orders_last(store: StateStore) -> None:
    store.put_snapshot(ALICE, 2**64 - 1, b"max")
    store.put_snapshot(ALICE, 0, b"zero")
    assert store.latest_snapshot(ALICE) == (2**64 - 1, b"max")


def test_deleting_snapshots_before_an_id_keeps_it_and_later_ones(store: StateStore) -> None:
    for snapshot_id in range(1, 8):
        store.put_snapshot(ALICE, snapshot_id, b"a%d" % snapshot_id)
        store.put_snapshot(BOB, snapshot_id, b"b%d" % snapshot_id)
    assert store.delete_snapshots_before(ALICE, 5) == 4
    assert [store.get_snapshot(ALICE, i) for i in range(1, 8)] == [None] * 4 + [b"a5", b"a6", b"a7"]
    assert all(store.get_snapshot(BOB, i) == b"b%d" % i for i in range(1, 8))
    assert store.delete_snapshots_before(ALICE, 5) == 0
    assert store.delete_snapshots_before(ALICE, 100) == 3
    assert store.latest_snapshot(ALICE) is None
    assert store.latest_snapshot(BOB) == (7, b"b7")


@pytest.mark.parametrize("bad_id", [-1, 2**64])
def test_a_snapshot_id_outside_64_bits_is_refused(store: StateStore, bad_id: int) -> None:
    with pytest.raises(StoreError, match="snapshot id"):
        store.put_snapshot(ALICE, bad_id, b"x")


@pytest.mark.parametrize("bad_agent", ["", "s1/\x00root"])
def test_an_empty_or_nul_agent_key_is_refused(store: StateStore, bad_agent: str) -> None:
    with pytest.raises(StoreError, match="agent key"):
        store.put_snapshot(bad_agent, 1, b"x")
    with pytest.raises(StoreError, match="agent key"):
        store.put_journal(bad_agent, "k", b"x")


# -- journal and completed index -------------------------------------------------------------------


def test_the_journal_is_scoped_by_agent(store: StateStore) -> None:
    store.put_journal(ALICE, "abc123", b"intent")
    assert store.get_journal(ALICE, "abc123") == b"intent"
    assert store.get_journal(BOB, "abc123") is None
    store.put_journal(ALICE, "abc123", b"result")
    store.put_journal(BOB, "abc123", b"bob's own call")
    assert store.get_journal(ALICE, "abc123") == b"result"
    assert store.get_journal(BOB, "abc123") == b"bob's own call"


def test_completed_sessions_list_in_id_order(store: StateStore) -> None:
    assert store.list_completed() == []
    store.put_completed("s-b", b"done b")
    store.put_completed("s-a", b"done a")
    assert store.get_completed("s-a") == b"done a"
    assert store.get_completed("s-c") is None
    assert store.list_completed() == [("s-a", b"done a"), ("s-b", b"done b")]


# -- generic records ----------------------------------------------------------------------------------


def test_a_batch_writes_across_databases_and_applies_deletes_after_puts(store: StateStore) -> None:
    store.write_batch([("meta", "gone", b"soon"), ("meta", "kept", b"old")])
    store.write_batch(
        [
            ("snapshots", snapshot_key(ALICE, 1), b"snap"),
            ("segments", f"{ALICE}/0001", b"seg"),
            ("defs", "writer@1", b"def"),
            ("meta", "kept", b"new"),
            ("meta", "both", b"put then deleted"),
        ],
        deletes=[("meta", "gone"), ("meta", "both"), ("meta", "never-existed")],
    )
    assert store.get_snapshot(ALICE, 1) == b"snap"
    assert store.get("segments", f"{ALICE}/0001") == b"seg"
    assert store.get("defs", "writer@1") == b"def"
    assert store.get("meta", "kept") == b"new"
    assert store.get("meta", "gone") is None
    assert store.get("meta", "both") is None


def test_a_batch_with_one_bad_record_writes_nothing(store: StateStore) -> None:
    with pytest.raises(StoreError, match="unknown store database 'nope'"):
        store.write_batch([("meta", "first", b"1"), ("nope", "second", b"2")])
    with pytest.raises(StoreError, match="empty"):
        store.write_batch([("meta", "first", b"1"), ("meta", "", b"2")])
    assert store.get("meta", "first") is None


@pytest.mark.parametrize("call", ["get", "scan", "delete"])
def test_an_unknown_database_name_is_a_store_error(store: StateStore, call: str) -> None:
    with pytest.raises(StoreError, match="unknown store database"):
        if call == "get":
            store.get("sessions", "k")
        elif call == "scan":
            store.scan("sessions", "")
        else:
            store.write_batch([], deletes=[("sessions", "k")])


def test_a_key_over_511_bytes_is_refused_and_511_is_fine(store: StateStore) -> None:
    store.write_batch([("meta", "k" * 511, b"fits")])
    assert store.get("meta", "k" * 511) == b"fits"
    with pytest.raises(StoreError, match="over"):
        store.write_batch([("meta", "k" * 512, b"too long")])
    with pytest.raises(StoreError, match="over"):
        store.write_batch([("meta", "é" * 256, b"512 bytes of UTF-8")])


def test_scan_returns_the_prefix_in_key_order(store: StateStore) -> None:
    keys = ["a/2", "a/10", "a/1", "ab", "b/1", "a/é", "a/z"]
    store.write_batch([("segments", key, key.encode()) for key in keys])
    assert [key for key, _ in store.scan("segments", "a/")] == ["a/1", "a/10", "a/2", "a/z", "a/é"]
    assert store.scan("segments", "a/1") == [("a/1", b"a/1"), ("a/10", b"a/10")]
    assert [key for key, _ in store.scan("segments", "")] == sorted(keys)
    assert store.scan("segments", "c") == []
    assert store.scan("defs", "") == []


def test_values_are_returned_byte_for_byte(store: StateStore) -> None:
    values = [b"", b"\x00" * 10, os.urandom(100_000), bytes(range(256))]
    store.write_batch([("segments", f"v{i}", value) for i, value in enumerate(values)])
    assert [store.get("segments", f"v{i}") for i in range(len(values))] == values


def test_a_closed_store_refuses_calls_and_closing_twice_is_harmless(store: StateStore) -> None:
    store.put_completed("s", b"x")
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get_completed("s")
    with pytest.raises(StoreError, match="closed"):
        store.put_completed("s", b"y")


def test_the_store_is_a_context_manager(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "db") as lmdb_store:
        lmdb_store.put_completed("s", b"x")
    with pytest.raises(StoreError, match="closed"):
        lmdb_store.get_completed("s")
    with MemoryStore() as memory_store:
        memory_store.put_completed("s", b"x")
    with pytest.raises(StoreError, match="closed"):
        memory_store.get_completed("s")


def test_many_threads_write_and_read_without_losing_a_record(store: StateStore) -> None:
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            for i in range(40):
                agent = f"s/t{thread}"
                store.write_batch(
                    [
                        ("snapshots", snapshot_key(agent, i), b"%d-%d" % (thread, i)),
                        ("journal", f"{agent}\x00call{i}", b"j"),
                    ]
                )
                latest = store.latest_snapshot(agent)
                assert latest is not None and latest[0] == i
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(store.scan("snapshots", "s/t")) == 8 * 40
    assert len(store.scan("journal", "s/t")) == 8 * 40


@pytest.mark.anyio
async def test_the_async_facade_runs_concurrent_calls_off_the_loop(store: StateStore) -> None:
    facade = AsyncStore(store)

    async def write(i: int) -> None:
        await facade.put_snapshot(ALICE, i, b"%d" % i)
        await facade.write_batch([("segments", f"{ALICE}/{i:04d}", b"seg")])
        await facade.put_journal(ALICE, f"call{i}", b"j")

    async with anyio.create_task_group() as group:
        for i in range(30):
            group.start_soon(write, i)
    await facade.put_completed("s1", b"done")

    assert await facade.latest_snapshot(ALICE) == (29, b"29")
    assert await facade.get_snapshot(ALICE, 3) == b"3"
    assert len(await facade.scan("segments", ALICE)) == 30
    assert await facade.get("segments", f"{ALICE}/0007") == b"seg"
    assert await facade.get_journal(ALICE, "call5") == b"j"
    assert await facade.delete_snapshots_before(ALICE, 29) == 29
    assert await facade.get_completed("s1") == b"done"
    assert await facade.list_completed() == [("s1", b"done")]
    async with facade:
        pass
    with pytest.raises(StoreError, match="closed"):
        await facade.get_completed("s1")


# -- LMDB only: what the disk must keep -----------------------------------------------------------


def test_records_survive_closing_and_reopening(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "db") as first:
        first.put_snapshot(ALICE, 4, b"snap")
        first.put_journal(ALICE, "k", b"journal")
        first.put_completed("s1", b"done")
    with LmdbStore(tmp_path / "db") as again:
        assert again.latest_snapshot(ALICE) == (4, b"snap")
        assert again.get_journal(ALICE, "k") == b"journal"
        assert again.list_completed() == [("s1", b"done")]


def test_a_data_dir_that_is_a_file_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("not a directory")
    with pytest.raises(StoreError, match="taken"):
        LmdbStore(tmp_path / "taken")


def test_a_full_map_is_store_full_and_loses_nothing_committed(tmp_path: Path) -> None:
    data_dir = tmp_path / "db"
    committed: dict[str, bytes] = {}
    with LmdbStore(data_dir, map_size=256 * 1024) as small, pytest.raises(StoreFull) as full:
        for i in range(1000):
            key, value = f"seg{i:04d}", bytes([i % 251]) * 3000
            small.write_batch([("segments", key, value)])
            committed[key] = value
    message = str(full.value)
    assert str(data_dir) in message and "map_size" in message
    assert len(committed) > 10

    with LmdbStore(data_dir, map_size=256 * 1024) as small:
        # A batch that cannot fit writes none of its records, not even the small first one.
        with pytest.raises(StoreFull):
            small.write_batch([("meta", "small", b"1"), ("meta", "huge", b"x" * 1_000_000)])
        assert small.get("meta", "small") is None
        assert small.scan("segments", "") == sorted(committed.items())
        usage = small.usage()
        assert usage.map_size == 256 * 1024 and usage.used_bytes > 200 * 1024

    # The remedy the message names works: a larger map_size, and everything is still there.
    with LmdbStore(data_dir, map_size=8 * 1024 * 1024) as larger:
        assert larger.scan("segments", "") == sorted(committed.items())
        larger.write_batch([("meta", "huge", b"x" * 1_000_000)])
        assert larger.get("meta", "huge") == b"x" * 1_000_000


# A writer that commits batches of self-checking records until it is killed. Each value is
# length + sha256 + payload; every batch also deletes the batch written KEEP batches earlier, so
# the kills land on page reuse as well as on fresh pages. It prints a batch number only after
# write_batch returned, i.e. after the commit was synced.
_BATCH_RECORDS = 6
_KEEP = 5
_WRITER = f"""
import hashlib, os, random, sys
from pathlib import Path
from apomesh.adapters.lmdb_store import LmdbStore

store = LmdbStore(Path(sys.argv[1]), map_size=256 << 20)
batch = int(sys.argv[2])
print("ready", flush=True)
while True:
    puts = []
    for record in range({_BATCH_RECORDS}):
        payload = os.urandom(random.randint(1, 20_000))
        value = len(payload).to_bytes(4, "big") + hashlib.sha256(payload).digest() + payload
        puts.append(("segments", f"b{{batch:08d}}/{{record}}", value))
    old = batch - {_KEEP}
    deletes = [("segments", f"b{{old:08d}}/{{record}}") for record in range({_BATCH_RECORDS})]
    store.write_batch(puts, deletes)
    print(batch, flush=True)
    batch += 1
"""


def _whole_batches(data_dir: Path) -> dict[int, int]:
    """Check every record is whole; return how many records each batch has on disk."""
    per_batch: dict[int, int] = {}
    with LmdbStore(data_dir, map_size=256 << 20) as reopened:
        for key, value in reopened.scan("segments", "b"):
            length = int.from_bytes(value[:4], "big")
            payload = value[36:]
            assert len(payload) == length, f"{key}: truncated record"
            assert hashlib.sha256(payload).digest() == value[4:36], f"{key}: corrupt record"
            batch = int(key[1:9])
            per_batch[batch] = per_batch.get(batch, 0) + 1
    return per_batch


def test_sigkill_mid_write_never_leaves_a_partial_record_or_batch(tmp_path: Path) -> None:
    data_dir = tmp_path / "db"
    rng = random.Random(1234)
    next_batch = 0
    kills = 0
    for _ in range(25):
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(data_dir), str(next_batch)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "ready"
        acknowledged = [int(writer.stdout.readline()) for _ in range(rng.randint(0, 12))]
        time.sleep(rng.random() * 0.004)  # land the kill at an arbitrary point of a commit
        writer.send_signal(signal.SIGKILL)
        rest, _ = writer.communicate()
        kills += writer.returncode == -signal.SIGKILL
        acknowledged += [int(line) for line in rest.split()]

        per_batch = _whole_batches(data_dir)
        partial = {batch: count for batch, count in per_batch.items() if count != _BATCH_RECORDS}
        assert partial == {}, f"batches only partly on disk after a kill: {partial}"
        if acknowledged:
            last = acknowledged[-1]
            # Every synced batch is still there unless a later batch deleted it; one more batch
            # may have committed after the last acknowledgement, deleting one more old batch.
            for batch in range(max(last - _KEEP + 2, next_batch), last + 1):
                assert batch in per_batch, f"acknowledged batch {batch} lost"
        next_batch = max(per_batch, default=next_batch - 1) + 1
    assert kills == 25
    assert next_batch > 0
