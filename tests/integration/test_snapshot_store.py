"""Agent snapshots on real LMDB: bytes written per node stay flat over a long agent, call counts
included, and a snapshot loads whole after compaction, a supervisor reset and a daemon restart
(a fresh ``SnapshotStore`` on the same store)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import msgspec
import pytest

from apomesh.adapters.lmdb_store import AsyncStore, LmdbStore, snapshot_key
from apomesh.plugins.api import Message
from apomesh.runtime.protocol import BudgetState, NodeReport
from apomesh.runtime.snapshots import SnapshotRecord, SnapshotStore, segment_key

AGENT = "s1/root"


def node(step: int, counts: dict[str, int], *, reset: bool = False) -> NodeReport:
    return NodeReport(
        "w1",
        "s1",
        "root",
        1,
        step=step,
        new_messages=[
            Message(role="assistant", content=f"call {step}"),
            Message(
                role="tool", content=f"wrote file {step}", tool_call_id=f"{step}.0", name="fs.write"
            ),
        ],
        model={"script_pos": step},
        budget=BudgetState(steps=step, tool_calls=step),
        reset=reset,
        call_counts=dict(counts),
    )


async def write(snapshots: SnapshotStore, report: NodeReport, after_id: int = 0) -> tuple[int, int]:
    """Stage and commit one node's snapshot: (snapshot id, bytes written)."""
    staged = await snapshots.stage(AGENT, None, report, after_id=after_id)
    await snapshots.commit([staged])
    return staged.snapshot_id, staged.written


@pytest.mark.anyio
async def test_bytes_per_node_stay_flat_while_call_counts_grow(tmp_path: Path) -> None:
    store = AsyncStore(LmdbStore(tmp_path / "db"))
    snapshots = SnapshotStore(store, compact_every=16)
    counts: dict[str, int] = {}
    sizes: dict[int, int] = {}
    for step in range(1, 401):
        counts[f"{step:064x}"] = 1  # a new journaled call every node, like a writing agent
        _, sizes[step] = await write(snapshots, node(step, counts))

    def typical(steps: range) -> float:
        return statistics.median(sizes[s] for s in steps)

    assert typical(range(380, 400)) <= typical(range(2, 22)) + 16
    memory = await snapshots.load(AGENT)
    assert memory is not None
    assert memory.call_counts == counts
    assert len(memory.messages) == 2 * 400
    assert memory.messages[-1].content == "wrote file 400"
    await store.aclose()


@pytest.mark.anyio
async def test_counts_survive_a_reset_and_a_restart(tmp_path: Path) -> None:
    store = AsyncStore(LmdbStore(tmp_path / "db"))
    first = SnapshotStore(store, compact_every=4)
    counts = {"a": 1}
    await write(first, node(1, counts))
    counts["a"] = 2
    counts["b"] = 1
    await write(first, node(2, counts))
    await write(first, node(3, counts, reset=True))

    restarted = SnapshotStore(store, compact_every=4)  # a new daemon on the same data dir
    memory = await restarted.load(AGENT)
    assert memory is not None
    assert memory.call_counts == {"a": 2, "b": 1}
    assert [m.content for m in memory.messages] == ["call 3", "wrote file 3"]  # after the reset
    counts["c"] = 1
    await write(restarted, node(4, counts))
    memory = await restarted.load(AGENT)
    assert memory is not None
    assert memory.call_counts == {"a": 2, "b": 1, "c": 1}
    assert memory.step == 4
    await store.aclose()


@pytest.mark.anyio
async def test_a_record_that_holds_its_counts_whole_still_loads(tmp_path: Path) -> None:
    store = AsyncStore(LmdbStore(tmp_path / "db"))
    encoder = msgspec.msgpack.Encoder()
    old_record = SnapshotRecord(
        step=1,
        base_seq=0,
        last_seq=0,
        model={},
        budget=BudgetState(steps=1),
        source="node",
        call_counts={"a": 3},
    )
    await store.write_batch(
        [
            (
                "segments",
                segment_key(AGENT, 0),
                encoder.encode([Message(role="user", content="hi")]),
            ),
            ("snapshots", snapshot_key(AGENT, 1), encoder.encode(old_record)),
        ]
    )
    snapshots = SnapshotStore(store)
    memory = await snapshots.load(AGENT)
    assert memory is not None
    assert memory.call_counts == {"a": 3}
    assert [m.content for m in memory.messages] == ["hi"]
    await write(snapshots, node(2, {"a": 3, "b": 1}))
    memory = await snapshots.load(AGENT)
    assert memory is not None
    assert memory.call_counts == {"a": 3, "b": 1}
    await store.aclose()


@pytest.mark.anyio
async def test_every_earlier_snapshot_loads_its_own_messages_after_compaction(
    tmp_path: Path,
) -> None:
    store = AsyncStore(LmdbStore(tmp_path / "db"))
    snapshots = SnapshotStore(store, compact_every=4)
    counts: dict[str, int] = {}
    ids: dict[int, int] = {}
    for step in range(1, 12):
        counts[f"{step:064x}"] = 1
        ids[step], _ = await write(snapshots, node(step, counts))
    for step, snapshot_id in ids.items():
        # Steps 1-4 and 5-8 were merged into one segment each: a snapshot in the middle of a
        # merged segment holds exactly the messages of its own steps.
        memory = await snapshots.load(AGENT, snapshot_id)
        assert memory is not None
        assert [m.content for m in memory.messages][-1] == f"wrote file {step}"
        assert len(memory.messages) == 2 * step
        assert memory.call_counts == {f"{s:064x}": 1 for s in range(1, step + 1)}
    await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "logged", [3, 4, 5, 6], ids=["before-compaction", "at-4", "after-4", "all-logged"]
)
async def test_a_dispatch_continues_from_the_logged_snapshot_and_the_unlogged_ones_vanish(
    tmp_path: Path, logged: int
) -> None:
    # Nodes 1..6 stored (node 4 compacts, compact_every=4) but the log points only at ``logged``:
    # the daemon stopped before logging the rest. A new daemon continues from ``logged``.
    store = AsyncStore(LmdbStore(tmp_path / "db"))
    first = SnapshotStore(store, compact_every=4)
    for step in range(1, 7):
        await write(first, node(step, {"k": step}))
    restarted = SnapshotStore(store, compact_every=4)
    memory = await restarted.load_logged(AGENT, logged)
    assert memory is not None and memory.step == logged
    assert [m.content for m in memory.messages][-1] == f"wrote file {logged}"
    assert len(memory.messages) == 2 * logged and memory.call_counts == {"k": logged}
    assert [i for i, _ in await restarted.records(AGENT)] == list(range(1, logged + 1))
    # The tail it keeps from that one read is the one the store now holds.
    assert restarted._tails[AGENT] == await SnapshotStore(store, compact_every=4)._tail(AGENT)
    # The agent goes on from there: its next nodes hold none of the unlogged ones' messages.
    for step in range(logged + 1, logged + 8):
        await write(restarted, node(step, {"k": 100 + step}), after_id=step - 1)
    again = await SnapshotStore(store, compact_every=4).load(AGENT)
    assert again is not None
    steps = [m.content for m in again.messages if m.role == "tool"]
    assert steps == [f"wrote file {n}" for n in range(1, logged + 8)]
    assert again.call_counts == {"k": 100 + logged + 7}
    await store.aclose()


@pytest.mark.anyio
async def test_an_agent_with_no_logged_snapshot_starts_afresh(tmp_path: Path) -> None:
    store = AsyncStore(LmdbStore(tmp_path / "db"))
    snapshots = SnapshotStore(store)
    await write(snapshots, node(1, {}))  # stored, its pointer never logged
    assert await snapshots.load_logged(AGENT, None) is None
    assert await snapshots.records(AGENT) == []
    assert snapshots._tails[AGENT] == await SnapshotStore(store)._tail(AGENT)
    await store.aclose()


@pytest.mark.anyio
async def test_a_staged_snapshot_is_stored_only_when_committed_and_one_dropped_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A node's snapshot staged and committed later with the next one (the deferred node) loads
    whole; one staged and never committed (its daemon died, or its commit failed) leaves no
    message behind, not even in a segment compacted later, and its id is never staged again."""
    store = AsyncStore(LmdbStore(tmp_path / "db"))
    snapshots = SnapshotStore(store, compact_every=4)
    first = await snapshots.stage(AGENT, None, node(1, {"a": 1}))
    second = await snapshots.stage(AGENT, None, node(2, {"b": 1}), on=first)
    assert await store.latest_snapshot(AGENT) is None  # nothing stored while staged
    await snapshots.commit([first, second])
    memory = await snapshots.load(AGENT)
    assert memory is not None and memory.step == 2 and len(memory.messages) == 4
    assert memory.call_counts == {"a": 1, "b": 1}

    dropped = await snapshots.stage(AGENT, None, node(3, {"c": 1}))
    for step in range(4, 12):  # past a compaction (every 4 segments)
        staged = await snapshots.stage(AGENT, None, node(step, {}))
        await snapshots.commit([staged])
    assert staged.snapshot_id > dropped.snapshot_id  # the dropped id is never staged again
    memory = await snapshots.load(AGENT)
    assert memory is not None and memory.step == 11
    contents = [m.content for m in memory.messages]
    assert "call 3" not in contents and "wrote file 3" not in contents
    assert len(contents) == 2 * 10
    assert memory.call_counts == {"a": 1, "b": 1}
    await store.aclose()


@pytest.mark.anyio
async def test_a_compaction_whose_deletes_never_landed_loads_each_part_once(
    tmp_path: Path,
) -> None:
    """On the replicated store a write cut off part way can leave a compaction's merged segment
    beside the small segments it replaces (its whole values land before its deletes). A load
    takes each node's part once, and the next dispatch deletes the segments the merged one
    holds, so the agent goes on from a clean tail."""
    store = AsyncStore(LmdbStore(tmp_path / "db"))
    snapshots = SnapshotStore(store, compact_every=4)
    write_batch = store.write_batch

    async def deletes_lost(puts: Any, deletes: Any = ()) -> None:
        await write_batch(puts)

    for step in range(1, 7):  # node 4 compacts 1..4 into one segment
        store.write_batch = deletes_lost if step == 4 else write_batch  # type: ignore[method-assign]
        await write(snapshots, node(step, {"k": step}))
    store.write_batch = write_batch  # type: ignore[method-assign]
    assert len(await store.scan("segments", AGENT + "\x00")) == 6  # 1, 2, 3, merged 1..4, 5, 6

    for snapshot_id in range(1, 7):
        memory = await snapshots.load(AGENT, snapshot_id)
        assert memory is not None
        assert [m.content for m in memory.messages if m.role == "tool"] == [
            f"wrote file {n}" for n in range(1, snapshot_id + 1)
        ]
    restarted = SnapshotStore(store, compact_every=4)
    memory = await restarted.load_logged(AGENT, 6)
    assert memory is not None and len(memory.messages) == 12 and memory.call_counts == {"k": 6}
    assert [key for key, _ in await store.scan("segments", AGENT + "\x00")] == [
        segment_key(AGENT, n) for n in (3, 4, 5)
    ]
    for step in range(7, 10):
        await write(restarted, node(step, {"k": step}), after_id=step - 1)
    again = await SnapshotStore(store, compact_every=4).load(AGENT)
    assert again is not None
    assert [m.content for m in again.messages if m.role == "tool"] == [
        f"wrote file {n}" for n in range(1, 10)
    ]
    await store.aclose()
