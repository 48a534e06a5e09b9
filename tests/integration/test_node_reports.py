"""A node's journaled results travel with its node report: on a real daemon (``Node`` with its
embedded nats-server, in-process workers, real LMDB), every side-effecting call's intent and
result are on the log before the snapshot pointer of the node that made it, and LMDB's journal
copy holds the results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from apomesh.core.events import AgentSnapshotted, ToolCallIntent, ToolCallRecorded
from apomesh.runtime.config import load_config
from apomesh.runtime.node import Node


def writer(turns: list[list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "name": "writer",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": ["fs.write"],
        "model": {
            "provider": "scripted",
            "turns": [{"tool_calls": calls} for calls in turns] + [{"final": "written"}],
        },
    }


def write(path: str, content: str) -> dict[str, Any]:
    return {"tool": "fs.write", "args": {"path": path, "content": content}}


def count_commits(node: Node) -> list[list[str]]:
    """A list that fills with the databases each of the node's store commits writes to."""
    assert node.daemon is not None
    store = node.daemon.store
    batches: list[list[str]] = []
    write_batch = store.write_batch

    async def counted(puts: Any, deletes: Any = ()) -> None:
        batches.append([db for db, _, _ in puts])
        await write_batch(puts, deletes)

    store.write_batch = counted  # type: ignore[method-assign]
    return batches


def one_worker_config(tmp_path: Path, **overrides: Any) -> Any:
    """A daemon with one in-process worker and the built-in plugins, its data under ``tmp_path``."""
    return load_config(
        None,
        env={},
        overrides={
            "daemon": {"data_dir": str(tmp_path / "data"), "workers": 1},
            "plugins": {"allow": ["apomesh"]},
            **overrides,
        },
    )


@pytest.mark.anyio
async def test_results_are_logged_before_their_nodes_snapshot(tmp_path: Path) -> None:
    config = one_worker_config(tmp_path)
    async with Node(config, http=False) as node:
        assert node.daemon is not None and node.service is not None
        for _, worker in node.workers:
            await worker.wait_registered()
        agent = writer([[write("a.txt", "one")], [write("b.txt", "two"), write("c.txt", "three")]])
        batches = count_commits(node)
        session_id = await node.service.create_session(
            "write", agent=None, definition=agent, by="t"
        )
        runtime = node.daemon.registry.live[session_id]
        assert runtime.task is not None
        await runtime.task
        envelopes = await node.daemon.log.read(session_id)
        journal = await node.daemon.store.scan("journal", f"{session_id}/root\x00")

    assert runtime.state.status == "completed"
    workspace = config.daemon.workspace_path() / session_id
    assert [(workspace / n).read_text() for n in ("a.txt", "b.txt", "c.txt")] == [
        "one",
        "two",
        "three",
    ]
    events = [e.event for e in envelopes]
    steps: list[list[str]] = [[]]
    for ev in events:
        if isinstance(ev, ToolCallIntent | ToolCallRecorded):
            steps[-1].append(
                f"{type(ev).__name__}:{ev.tool}:{ev.outcome if isinstance(ev, ToolCallRecorded) else ''}"
            )
        elif isinstance(ev, AgentSnapshotted) and ev.source == "turn":
            steps[-1].append("turn")
        elif isinstance(ev, AgentSnapshotted):
            steps.append([])
    # Each model turn is recorded (its pointer, source "turn") before its first intent.
    assert steps[:2] == [
        ["turn", "ToolCallIntent:fs.write:", "ToolCallRecorded:fs.write:ok"],
        ["turn"] + ["ToolCallIntent:fs.write:", "ToolCallRecorded:fs.write:ok"] * 2,
    ]
    records = [msgspec.msgpack.decode(value) for _, value in journal]
    assert sorted(r["outcome"] for r in records) == ["ok", "ok", "ok"]
    # One commit a step: a node's snapshot goes with the next turn's record (the turn's report
    # carries the node), and the journal copies (an intent, or a result replacing it) ride in
    # the agent's next commit, which is always after the log has them: the last node's results
    # are copied with the dispatch's Done.
    assert batches == [
        ["defs", "segments", "snapshots"],
        ["segments", "snapshots", "snapshots", "journal"],
        ["segments", "snapshots", "snapshots", "journal", "journal", "journal"],
        ["journal"],
    ], batches
    assert runtime.state.side_effects == 3


@pytest.mark.anyio
@pytest.mark.parametrize("delay", [0.0, 0.05])
async def test_a_node_is_stored_alone_when_its_next_turn_is_slow_or_with_no_delay(
    tmp_path: Path, delay: float
) -> None:
    """``node_commit_delay``: with 0 each node is reported at once and stored and logged with
    its results (two commits a side-effecting step); with a model slower than the delay, the
    node waiting for its next turn is sent, stored and logged alone, before that turn."""
    config = one_worker_config(tmp_path, snapshots={"node_commit_delay": delay})
    async with Node(config, http=False) as node:
        assert node.daemon is not None and node.service is not None
        for _, worker in node.workers:
            await worker.wait_registered()
        agent = writer([[write("a.txt", "one")], [write("b.txt", "two")]])
        agent["model"]["turns"][1]["delay"] = 0.3  # the second turn comes after the delay
        batches = count_commits(node)
        session_id = await node.service.create_session("slow", agent=None, definition=agent, by="t")
        runtime = node.daemon.registry.live[session_id]
        assert runtime.task is not None
        await runtime.task
        envelopes = await node.daemon.log.read(session_id)
    assert runtime.state.status == "completed"
    sources = [e.event.source for e in envelopes if isinstance(e.event, AgentSnapshotted)]
    assert sources == ["turn", "node", "turn", "node", "turn"], sources
    if delay == 0:
        assert [b.count("snapshots") for b in batches] == [1, 1, 1, 1, 1], batches
    else:
        # The first node waited longer than the delay for its next turn: sent and stored
        # alone. The second node's next turn (the final answer) came at once and carried it:
        # one commit for both; its result's journal copy goes with the dispatch's Done.
        assert [b.count("snapshots") for b in batches] == [1, 1, 1, 2, 0], batches
        assert batches[1] == ["segments", "snapshots", "journal"], batches


@pytest.mark.anyio
async def test_in_process_workers_report_over_the_local_link_with_the_same_checks(
    tmp_path: Path,
) -> None:
    """An in-process worker's reports to its own daemon skip NATS (``ControlPlane.local_link``)
    and meet the same checks: the session completes with no report on the daemon's control
    subjects, and a report naming another worker is fenced."""
    from apomesh.runtime.protocol import ENCODER, Done

    config = one_worker_config(tmp_path)
    async with Node(config, http=False) as node:
        assert node.daemon is not None and node.service is not None
        ((_, worker),) = node.workers
        await worker.wait_registered()
        assert set(worker.local_links) == {node.daemon.daemon_id}
        over_nats: list[str] = []
        original = node.daemon.control._process_report

        async def counted(msg: Any) -> None:
            over_nats.append(msg.subject)
            await original(msg)

        node.daemon.control._process_report = counted  # type: ignore[method-assign]
        agent = writer([[write("a.txt", "one")]])
        session_id = await node.service.create_session(
            "write", agent=None, definition=agent, by="t"
        )
        runtime = node.daemon.registry.live[session_id]
        assert runtime.task is not None
        await runtime.task
        assert runtime.state.status == "completed"
        assert over_nats == []

        link = worker.local_links[node.daemon.daemon_id]
        forged = Done("another-worker", session_id, "root", 1, outcome="final", output="x")
        reply = await link(forged, ENCODER.encode(forged))
        assert reply.status == "fenced"
        assert "cannot report as another-worker" in reply.message


@pytest.mark.anyio
async def test_dispatches_to_in_process_workers_skip_nats(tmp_path: Path) -> None:
    """A daemon hands its dispatches to its in-process workers directly
    (``Worker.take_dispatch``, the handler of a dispatch over NATS too): a session completes
    with no request on a dispatch subject."""
    from apomesh.runtime.protocol import DISPATCH_DECODER, DISPATCH_PREFIX, Run

    config = one_worker_config(tmp_path)
    async with Node(config, http=False) as node:
        assert node.daemon is not None and node.service is not None
        ((_, worker),) = node.workers
        await worker.wait_registered()
        pool = node.daemon.workers
        assert set(pool.local_workers) == {worker.worker_id}
        over_nats: list[str] = []
        request = pool.nc.request

        async def counted(subject: str, *args: Any, **kwargs: Any) -> Any:
            over_nats.append(subject)
            return await request(subject, *args, **kwargs)

        pool.nc.request = counted  # type: ignore[method-assign]
        taken: list[Any] = []
        take = pool.local_workers[worker.worker_id]

        def seen(data: bytes, headers: Any) -> Any:
            taken.append(DISPATCH_DECODER.decode(data))
            return take(data, headers)

        pool.local_workers[worker.worker_id] = seen
        session_id = await node.service.create_session(
            "write", agent=None, definition=writer([[write("a.txt", "one")]]), by="t"
        )
        runtime = node.daemon.registry.live[session_id]
        assert runtime.task is not None
        await runtime.task
    assert runtime.state.status == "completed"
    assert [(r.session_id, r.agent) for r in taken if isinstance(r, Run)] == [(session_id, "root")]
    assert not [s for s in over_nats if s.startswith(DISPATCH_PREFIX)], over_nats


@pytest.mark.anyio
async def test_a_report_carries_only_the_call_counts_that_changed(tmp_path: Path) -> None:
    """An agent making twelve different side-effecting calls, one a node: each report carries
    the counts its node changed (one, or none), not every count so far, and the stored memory
    still holds all twelve (a dispatch from it keys a repeat right)."""
    config = one_worker_config(tmp_path)
    async with Node(config, http=False) as node:
        assert node.daemon is not None and node.service is not None
        for _, worker in node.workers:
            await worker.wait_registered()
        snapshots = node.daemon.snapshots
        carried: list[int] = []
        stage_snapshot = snapshots.stage

        async def counted(agent_key: str, config: Any, report: Any, **kw: Any) -> Any:
            carried.append(len(report.call_counts))
            return await stage_snapshot(agent_key, config, report, **kw)

        snapshots.stage = counted  # type: ignore[method-assign]
        agent = writer([[write(f"f{n}.txt", str(n))] for n in range(12)])
        session_id = await node.service.create_session(
            "counts", agent=None, definition=agent, by="t"
        )
        runtime = node.daemon.registry.live[session_id]
        assert runtime.task is not None
        await runtime.task
        memory = await snapshots.load(f"{session_id}/root")
    assert runtime.state.status == "completed"
    assert len(carried) >= 12 and max(carried) <= 1, carried
    assert memory is not None and len(memory.call_counts) == 12
