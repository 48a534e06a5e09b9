"""The replicated state store on real parts: LMDB and the ``APOMESH_STATE`` bucket on a real
nats-server (one node, and the 3-node cluster). What a peer with an empty data dir reads back,
compaction deletes, a grouped write's records as LMDB leaves them, what a write cut off part way
leaves, no acknowledgement without NATS, and nothing acknowledged lost when a cluster node is
SIGKILLed."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from tests.store_support import empty_replicated_store, replicated_store

from apomesh.adapters.lmdb_store import AsyncStore, snapshot_key
from apomesh.adapters.replicated_store import STATE_BUCKET
from apomesh.core.errors import LogUnavailable, StoreError, StoreUnavailable

AGENT = "s1/root"


def test_a_peer_with_an_empty_data_dir_reads_every_record_back(
    nats_url: str, tmp_path: Path
) -> None:
    first = empty_replicated_store(nats_url, tmp_path / "a")
    first.write_batch(
        [
            ("defs", AGENT, b"definition"),
            ("segments", f"{AGENT}\x0000000000", b"seg0"),
            ("segments", f"{AGENT}\x0000000001", b"seg1"),
            ("snapshots", snapshot_key(AGENT, 1), b"snap1"),
            ("snapshots", snapshot_key(AGENT, 2), b"turn2"),
            ("completed", "s0", b"done"),
            ("meta", "daemon_id", b"daemon-a"),
        ]
    )
    first.put_journal(AGENT, "call", b"intent")
    first.close()
    shutil.rmtree(tmp_path / "a")  # the host is gone with its disk

    peer = replicated_store(nats_url, tmp_path / "b")
    try:
        assert peer.latest_snapshot(AGENT) == (2, b"turn2")
        assert peer.get_snapshot(AGENT, 1) == b"snap1"
        assert peer.scan("segments", f"{AGENT}\x00") == [
            (f"{AGENT}\x0000000000", b"seg0"),
            (f"{AGENT}\x0000000001", b"seg1"),
        ]
        assert peer.get("defs", AGENT) == b"definition"
        assert peer.get_journal(AGENT, "call") == b"intent"
        assert peer.list_completed() == [("s0", b"done")]
        assert peer.get("meta", "daemon_id") is None  # the daemon's identity stays on its host
        # What was read is cached in the peer's LMDB.
        assert peer.local.get("defs", AGENT) == b"definition"
        assert peer.local.get("segments", f"{AGENT}\x0000000001") == b"seg1"
    finally:
        peer.close()


def test_a_value_larger_than_a_message_is_split_and_read_back_whole(
    nats_url: str, tmp_path: Path
) -> None:
    store = empty_replicated_store(nats_url, tmp_path / "a")
    store.replica.chunk = 4096  # many parts from a small value
    big = bytes(range(256)) * 200  # 51 200 bytes: 13 parts
    store.write_batch([("segments", f"{AGENT}\x0000000000", big)])
    peer = replicated_store(nats_url, tmp_path / "b")
    try:
        assert peer.get("segments", f"{AGENT}\x0000000000") == big
        assert peer.scan("segments", AGENT + "\x00") == [(f"{AGENT}\x0000000000", big)]
        store.write_batch([], [("segments", f"{AGENT}\x0000000000")])
        assert peer.scan("segments", AGENT + "\x00") == []
        assert _live_subjects(nats_url) == []  # its parts went with it
        # One real value over the server's max_payload (8 MiB) goes through too.
        store.replica.chunk = peer.replica.chunk
        huge = b"x" * (9 * 1024 * 1024)
        store.put_snapshot(AGENT, 1, huge)
        shutil.rmtree(tmp_path / "b")
        peer.close()
        peer = replicated_store(nats_url, tmp_path / "b")
        assert peer.get_snapshot(AGENT, 1) == huge
    finally:
        store.close()
        peer.close()


def test_compaction_deletes_reach_the_replica(nats_url: str, tmp_path: Path) -> None:
    store = empty_replicated_store(nats_url, tmp_path / "a")
    segments = [("segments", f"{AGENT}\x00{seq:08x}", b"s%d" % seq) for seq in range(4)]
    store.write_batch(segments)
    for snapshot_id in range(1, 6):
        store.put_snapshot(AGENT, snapshot_id, b"v%d" % snapshot_id)
    # The compaction a SnapshotStore does: the merged segment under the last key, the rest gone.
    store.write_batch(
        [("segments", f"{AGENT}\x0000000003", b"merged")],
        [(db, key) for db, key, _ in segments[:3]],
    )
    assert store.delete_snapshots_before(AGENT, 4) == 3
    store.close()
    peer = replicated_store(nats_url, tmp_path / "b")
    try:
        assert peer.scan("segments", AGENT + "\x00") == [(f"{AGENT}\x0000000003", b"merged")]
        assert [key for key, _ in peer.scan("snapshots", AGENT + "\x00")] == [
            snapshot_key(AGENT, 4),
            snapshot_key(AGENT, 5),
        ]
        assert peer.get_snapshot(AGENT, 1) is None
    finally:
        peer.close()


def test_a_batch_that_fails_midway_leaves_nothing_in_either_store(
    nats_url: str, tmp_path: Path
) -> None:
    store = empty_replicated_store(nats_url, tmp_path / "a")
    try:
        with pytest.raises(StoreError):  # a bad record: refused before anything is sent
            store.write_batch([("segments", f"{AGENT}\x0000000000", b"ok"), ("nope", "k", b"")])
        # A message the server refuses in the middle of the batch (over its max_payload): the
        # messages before it were sent, but the batch never commits.
        store.replica.chunk = 64 * 1024 * 1024
        with pytest.raises(StoreError):
            store.write_batch(
                [
                    ("segments", f"{AGENT}\x0000000000", b"first"),
                    ("segments", f"{AGENT}\x0000000001", b"x" * (9 * 1024 * 1024)),
                    ("snapshots", snapshot_key(AGENT, 1), b"record"),
                ]
            )
        assert store.local.scan("segments", "") == []
        time.sleep(0.2)
        assert _live_subjects(nats_url) == []
    finally:
        store.close()


def test_no_write_is_acknowledged_while_nats_is_down(
    fresh_nats_server: Any, tmp_path: Path
) -> None:
    store = replicated_store(fresh_nats_server.url, tmp_path / "a", timeout=1.0)
    try:
        store.put_snapshot(AGENT, 1, b"before")
        fresh_nats_server.kill()
        with pytest.raises(StoreUnavailable):
            store.put_snapshot(AGENT, 2, b"while down")
        assert store.local.get_snapshot(AGENT, 2) is None  # LMDB was not written either
        fresh_nats_server.start()
        deadline = time.monotonic() + 20
        while True:  # the connection comes back by itself
            try:
                store.put_snapshot(AGENT, 3, b"after")
                break
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert store.latest_snapshot(AGENT) == (3, b"after")
    finally:
        store.close()


def test_nothing_acknowledged_is_lost_when_a_cluster_node_is_sigkilled(
    nats_cluster: Any, tmp_path: Path
) -> None:
    urls = list(nats_cluster.urls)
    store = replicated_store(urls, tmp_path / "a", replicas=3, timeout=2.0)
    acknowledged: list[int] = []
    killed = None
    try:
        assert _replicas(urls[0]) == 3
        leader = _leader(urls[0])
        deadline = time.monotonic() + 60
        snapshot_id = 0
        while len(acknowledged) < 60 and time.monotonic() < deadline:
            snapshot_id += 1
            if snapshot_id == 20:  # SIGKILL the bucket's leader mid-run
                killed = next(s for s in nats_cluster if s.spec.name == leader)
                killed.kill()
            try:
                store.write_batch(
                    [
                        ("segments", f"{AGENT}\x00{snapshot_id:08x}", b"seg%d" % snapshot_id),
                        ("snapshots", snapshot_key(AGENT, snapshot_id), b"rec%d" % snapshot_id),
                    ]
                )
            except StoreUnavailable:
                continue  # not acknowledged: the caller would retry; nothing is promised
            acknowledged.append(snapshot_id)
        assert killed is not None and len(acknowledged) == 60
    finally:
        store.close()
    survivors = [s.url for s in nats_cluster if s is not killed]
    # The kill may also have taken JetStream's meta leader: opening the bucket waits out the
    # election (an open that times out meanwhile is tried again, as a restarting peer would).
    opening = time.monotonic() + 60
    while True:
        try:
            peer = replicated_store(survivors, tmp_path / "b", replicas=3)
            break
        except LogUnavailable:
            if time.monotonic() > opening:
                raise
            time.sleep(0.5)
    try:
        found = dict(peer.scan("snapshots", AGENT + "\x00"))
        segments = dict(peer.scan("segments", AGENT + "\x00"))
        for snapshot_id in acknowledged:
            assert found[snapshot_key(AGENT, snapshot_id)] == b"rec%d" % snapshot_id
            assert segments[f"{AGENT}\x00{snapshot_id:08x}"] == b"seg%d" % snapshot_id
    finally:
        peer.close()
        if killed is not None:
            killed.start()


# -- helpers ----------------------------------------------------------------------------------------


def _stream_info(url: str | list[str]) -> Any:
    async def info() -> Any:
        nc = await nats.connect(url)
        try:
            return await nc.jetstream().stream_info(f"KV_{STATE_BUCKET}")
        finally:
            await nc.close()

    return asyncio.run(info())


def _replicas(url: str) -> int:
    return int(_stream_info(url).config.num_replicas)


def _leader(url: str) -> str:
    return str(_stream_info(url).cluster.leader)


def _live_subjects(url: str) -> list[str]:
    """The bucket's subjects that hold a value (not a delete marker)."""

    async def subjects() -> list[str]:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value(STATE_BUCKET)
            try:
                return list(await kv.keys())
            except nats.js.errors.NoKeysError:
                return []
        finally:
            await nc.close()

    return asyncio.run(subjects())


@pytest.mark.anyio
async def test_while_nats_is_down_a_group_of_writes_fails_at_once_not_one_by_one(
    fresh_nats_server: Any, tmp_path: Path
) -> None:
    store = await asyncio.to_thread(
        replicated_store, fresh_nats_server.url, tmp_path / "a", timeout=0.5
    )
    attempts: list[int] = []  # the batch numbers each commit attempt carried
    write_batch, write_batches = store.write_batch, store.write_batches

    def one(puts: Any, deletes: Any = ()) -> None:
        attempts.append(int(puts[0][1][1:]))
        write_batch(puts, deletes)

    def many(batches: Any) -> None:
        attempts.extend(int(puts[0][1][1:]) for puts, _ in batches)
        write_batches(batches)

    store.write_batch, store.write_batches = one, many  # type: ignore[method-assign]
    facade = AsyncStore(store)
    failures: list[BaseException] = []
    fresh_nats_server.kill()

    async def write(i: int) -> None:
        try:
            await facade.write_batch([("segments", f"k{i:02d}", b"v")])
        except StoreUnavailable as exc:
            failures.append(exc)

    async with anyio.create_task_group() as group:
        for i in range(20):
            group.start_soon(write, i)
    assert len(failures) == 20  # nothing acknowledged
    assert sorted(attempts) == list(range(20))  # each batch was tried once, not again alone
    assert store.local.scan("segments", "") == []
    await facade.aclose()


def test_a_daemon_given_a_session_back_reads_what_the_peer_left_not_its_older_copy(
    nats_url: str, tmp_path: Path
) -> None:
    first = empty_replicated_store(nats_url, tmp_path / "a")
    first.write_batch(
        [
            ("snapshots", snapshot_key(AGENT, 1), b"logged"),
            ("snapshots", snapshot_key(AGENT, 2), b"stored, never logged"),
            ("segments", f"{AGENT}\x0000000001", b"merged 0..1"),
        ]
    )
    first.put_journal(AGENT, "call", b"intent")
    first.close()  # its daemon stops; its data dir stays
    peer = replicated_store(nats_url, tmp_path / "b")
    # The peer drops the unlogged snapshot and trims the segment to the logged one (what
    # ``SnapshotStore.load_logged`` does), writes its next snapshot under the freed id, and
    # records the call's result.
    peer.write_batch(
        [("segments", f"{AGENT}\x0000000001", b"merged 0")], [("snapshots", snapshot_key(AGENT, 2))]
    )
    peer.write_batch([("snapshots", snapshot_key(AGENT, 2), b"the peer's node")])
    peer.put_journal(AGENT, "call", b"result")
    peer.close()
    back = replicated_store(nats_url, tmp_path / "a")  # the first daemon, its old LMDB
    try:
        assert back.local.get_snapshot(AGENT, 2) == b"stored, never logged"
        assert back.get_snapshot(AGENT, 2) == b"the peer's node"
        assert back.latest_snapshot(AGENT) == (2, b"the peer's node")
        assert back.scan("segments", AGENT + "\x00") == [(f"{AGENT}\x0000000001", b"merged 0")]
        assert back.get_journal(AGENT, "call") == b"result"
    finally:
        back.close()


@pytest.mark.parametrize("replicas", [1, 3], ids=["R1-plain-then-atomic", "R3-atomic"])
def test_a_grouped_write_leaves_each_record_as_its_last_batch_did_in_both_stores(
    request: pytest.FixtureRequest, replicas: int, tmp_path: Path
) -> None:
    """A group of batches ends on the bucket as LMDB's one transaction of them does, whether its
    whole values go before its deletes (R1) or all in one atomic batch (R3): a record put and
    later deleted is gone, one deleted and put again is there."""
    if replicas == 1:
        urls: str | list[str] = request.getfixturevalue("nats_url")
    else:
        urls = list(request.getfixturevalue("nats_cluster").urls)
    store = empty_replicated_store(urls, tmp_path / "a", replicas=replicas)
    store.write_batch([("defs", "s1/b", b"old b"), ("defs", "s1/c", b"old c")])
    store.write_batches(
        [
            ([("defs", "s1/a", b"put then deleted")], [("defs", "s1/b")]),
            ([("defs", "s1/b", b"deleted then put")], [("defs", "s1/a")]),
            ([], [("defs", "s1/c")]),
        ]
    )
    expected = [("s1/b", b"deleted then put")]
    assert store.local.scan("defs", "s1/") == expected
    store.close()
    peer = replicated_store(urls, tmp_path / "b", replicas=replicas)
    try:
        assert peer.scan("defs", "s1/") == expected
    finally:
        peer.close()


def test_a_write_cut_off_after_its_whole_values_leaves_them_and_none_of_its_deletes(
    nats_url: str, tmp_path: Path
) -> None:
    """The bucket takes a write's whole values as plain publishes and its deletes and split
    values after them, atomically: cut off between the two, the write fails, LMDB is untouched
    and the bucket holds the whole values alone."""
    store = empty_replicated_store(nats_url, tmp_path / "a", timeout=0.5)
    store.write_batch([("segments", f"{AGENT}\x0000000000", b"small 0")])

    async def cut_off(messages: Any, *, timeout: float) -> None:
        raise nats.errors.TimeoutError  # the server never answers the atomic batch

    store.replica._send = cut_off  # type: ignore[method-assign]
    store.replica.chunk = 4096  # so the value below is split
    with pytest.raises(StoreUnavailable):
        store.write_batch(
            [
                ("segments", f"{AGENT}\x0000000001", b"merged 0..1"),
                ("snapshots", snapshot_key(AGENT, 1), b"x" * 10_000),
            ],
            [("segments", f"{AGENT}\x0000000000")],
        )
    assert store.local.scan("segments", "") == [(f"{AGENT}\x0000000000", b"small 0")]
    store.close()
    peer = replicated_store(nats_url, tmp_path / "b")
    try:
        assert peer.scan("segments", AGENT + "\x00") == [
            (f"{AGENT}\x0000000000", b"small 0"),
            (f"{AGENT}\x0000000001", b"merged 0..1"),
        ]
        assert peer.get_snapshot(AGENT, 1) is None  # split: it goes whole or not at all
    finally:
        peer.close()


def test_scan_here_answers_from_this_hosts_copy_and_scan_from_the_bucket(
    nats_url: str, tmp_path: Path
) -> None:
    """What a restart loads its fold checkpoints with (``scan_here``): the records this host
    wrote through, never a wait on the bucket for every record (100,000 of them outlasted the
    replica's timeout); a peer's records are in the bucket's ``scan`` only."""
    mine = empty_replicated_store(nats_url, tmp_path / "mine")
    peer = replicated_store(nats_url, tmp_path / "peer")
    try:
        mine.write_batch([("checkpoints", "s-mine", b"mine")])
        peer.write_batch([("checkpoints", "s-peer", b"peer")])
        assert mine.scan_here("checkpoints", "") == [("s-mine", b"mine")]
        assert mine.scan("checkpoints", "") == [("s-mine", b"mine"), ("s-peer", b"peer")]
    finally:
        peer.close()
        mine.close()
