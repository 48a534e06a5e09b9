"""Chaos on real processes: SIGKILLed workers, SIGKILLed daemons, a frozen (SIGSTOP) worker that
comes back as a zombie, and the single nats-server restarted mid-session.

Each scenario runs against a ``mesh`` (a nats-server, an ``apomesh serve`` process and
``apomesh worker`` processes, heartbeats every 0.3 s, a worker lost after 0.9 s of silence) and
checks what a user would notice: every session completes, every side effect happened exactly once
(or, for a call cut short and recorded as an unknown outcome, at most once), the log stays dense,
unduplicated and foldable, and the daemon's verification agrees with its store. The harness is
``tests/e2e/chaos_kit.py``; ``nox -s chaos`` runs the same kills by the hundred.
"""

from __future__ import annotations

import random
import time
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from tests.e2e.chaos_kit import Chaos, Tally, WorkerPool, appender, check_session

from apomesh.sdk.client import Client, EventRecord
from apomesh.testing import Mesh

WORKER_RUNS = 21
"""At least 20 worker kills: seven at each point (before, during, after a side-effecting call)."""
DAEMON_RUNS = 10
CONCURRENT_RUNS = 4


def _summary(tally: Tally) -> str:
    return (
        f"{tally.runs} runs, {tally.kills} kills {dict(tally.kill_points)}, "
        f"{tally.completed}/{tally.sessions} completed, {tally.duplicates} duplicates, "
        f"{tally.unknown_outcomes} unknown outcomes, problems: {tally.problems[:5]}"
    )


@pytest.mark.anyio
async def test_worker_killed_before_during_and_after_side_effects(mesh: Mesh) -> None:
    mesh.worker()
    mesh.worker()
    mesh.wait_workers(4)
    tally = Tally()
    points = ["before", "during", "after"] * (WORKER_RUNS // 3)
    random.Random(7).shuffle(points)
    async with Client(mesh.url) as client:
        chaos = Chaos(mesh, client, rng=random.Random(11), tally=tally)
        for wave in range(0, len(points), CONCURRENT_RUNS):
            async with anyio.create_task_group() as group:
                for n, point in enumerate(points[wave : wave + CONCURRENT_RUNS]):
                    group.start_soon(chaos.worker_kill_run, f"wk{wave + n}", point)
    assert tally.worker_kills >= 20, _summary(tally)
    assert not tally.problems, _summary(tally)
    assert tally.completed == tally.sessions == len(points), _summary(tally)
    assert tally.duplicates == 0
    assert set(tally.kill_points) == {"before", "during", "after"}


@pytest.mark.anyio
async def test_daemon_killed_at_random_points_and_restarted(mesh: Mesh) -> None:
    tally = Tally()
    async with Client(mesh.url) as client:
        chaos = Chaos(mesh, client, rng=random.Random(5), tally=tally)
        for run in range(DAEMON_RUNS):
            await chaos.daemon_kill_run(f"dk{run}", cli_resume=run % 3 == 0)
    assert tally.daemon_kills == DAEMON_RUNS
    assert not tally.problems, _summary(tally)
    assert tally.completed == tally.sessions, _summary(tally)
    assert tally.duplicates == 0
    assert tally.operator_resumes > 0, "no run left a session with side effects to resume"
    assert tally.auto_resumed > 0, "no run left a session to resume on its own"


# --- a frozen worker ------------------------------------------------------------------------------


async def _metric(url: str, name: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics")).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.anyio
async def test_frozen_worker_is_resumed_elsewhere_and_its_late_reports_are_fenced(
    mesh: Mesh,
) -> None:
    pool = WorkerPool(mesh)
    records: list[EventRecord] = []
    worker_of: dict[str, str] = {}
    zombie_id = ""
    zombie = None
    resumed_epoch = 0
    async with Client(mesh.url) as client:
        session_id = await client.start_session("frozen", definition=appender(4, delay=0.5))
        with anyio.fail_after(60):
            async for record in client.events(session_id):
                records.append(record)
                ev = record.event
                if record.kind == "AgentLifecycle" and ev.get("phase") == "dispatched":
                    worker_of[ev["agent"]] = ev["worker"]
                if (
                    zombie is None
                    and record.kind == "AgentSnapshotted"
                    and (ev["step"], ev["source"]) == (1, "node")
                ):
                    # Frozen in the middle of the model turn that leads to its second call (past
                    # the node report's answer): when it wakes up, that call is the first thing
                    # it sends, before it reads the cancel the daemon sent it meanwhile.
                    await anyio.sleep(0.2)
                    zombie_id = worker_of["root"]
                    zombie = pool.by_id(zombie_id)
                    assert zombie is not None
                    zombie.freeze()
                if record.kind == "AgentResuming":
                    resumed_epoch = ev["epoch"]
                if zombie is not None and resumed_epoch and record.kind == "AgentSnapshotted":
                    zombie.thaw()  # the agent has moved on elsewhere; the zombie wakes up now
                    zombie = None
                if record.kind == "SessionEnded":
                    break
        verification = await client.verify_session(session_id)
    assert resumed_epoch, "the frozen worker's agent was never resumed"
    check = check_session(records, verification, mesh.daemon.workspace)
    assert check.ok, check.problems
    assert check.unknown_outcomes == 0
    resuming = next(r for r in records if r.kind == "AgentResuming")
    assert resuming.event["worker"] == zombie_id
    after = [r for r in records if r.index > resuming.index]
    assert all(
        r.event.get("epoch") in (None, resumed_epoch)
        for r in after
        if r.kind in ("AgentLifecycle", "AgentResumed")
    )
    assert not [
        r for r in after if r.kind == "AgentLifecycle" and r.event.get("worker") == zombie_id
    ], "something from the zombie's old dispatch was appended"
    # Each step's turn (recorded before its call) and node, once each and in order.
    steps = [
        (r.event["step"], r.event["source"] != "turn")
        for r in records
        if r.kind == "AgentSnapshotted"
    ]
    assert steps == sorted(set(steps)), f"a snapshot was taken twice: {steps}"
    # The zombie's late report reaches the daemon once it runs again, and is refused.
    deadline = time.monotonic() + 15
    while "fenced" not in mesh.daemon.output_tail(200_000) and time.monotonic() < deadline:
        await anyio.sleep(0.1)
    fenced = [
        line
        for line in mesh.daemon.output_tail(200_000).splitlines()
        if "fenced" in line and zombie_id in line
    ]
    assert fenced, "the zombie's late report was not fenced"
    assert await _metric(mesh.url, "apomesh_fenced_reports_total") > 0


# --- the nats-server restarted --------------------------------------------------------------------


async def _prefix(client: Client, session_id: str) -> list[EventRecord]:
    """The session's events up to its current last index."""
    last = (await client.get_session(session_id)).last_index
    records: list[EventRecord] = []
    if last < 0:
        return records
    async for record in client.events(session_id):
        records.append(record)
        if record.index >= last:
            break
    return records


@pytest.mark.anyio
async def test_nats_server_restarted_mid_session_loses_nothing_acknowledged(mesh: Mesh) -> None:
    definitions: dict[str, Any] = {
        "nats-a": appender(6, delay=0.25),
        "nats-b": appender(6, delay=0.25),
        "nats-c": appender(6, delay=0.25),
        # A daemon-side job that finishes while the server is away: its result waits to be logged.
        "nats-job": {
            "name": "sleeper",
            "version": "1.0.0",
            "tools": ["jobs.sleep"],
            "model": {
                "provider": "scripted",
                "turns": [
                    {"tool_calls": [{"tool": "jobs.sleep", "args": {"seconds": 1.2}}]},
                    {"final": "slept"},
                ],
            },
        },
    }
    async with Client(mesh.url, reconnect_window=120) as client:
        ids = [await client.start_session(g, definition=d) for g, d in definitions.items()]
        await anyio.sleep(0.7)
        before = {sid: await _prefix(client, sid) for sid in ids}
        assert all(before.values())
        await anyio.to_thread.run_sync(mesh.server.stop)  # graceful: JetStream flushes its files
        # Longer than an append's own retry budget (5 s): the daemon's steps wait for the log.
        await anyio.sleep(6.0)
        await anyio.to_thread.run_sync(mesh.server.start)
        checks = []
        for session_id in ids:
            records: list[EventRecord] = []
            with anyio.fail_after(90):
                async for record in client.events(session_id):
                    records.append(record)
            checks.append(
                check_session(
                    records, await client.verify_session(session_id), mesh.daemon.workspace
                )
            )
            kept = [(r.index, r.event_id) for r in records[: len(before[session_id])]]
            assert kept == [(r.index, r.event_id) for r in before[session_id]], (
                "an acknowledged event was lost"
            )
    for check in checks:
        assert check.ok, check.problems
        assert check.status == "completed"
    # The daemon was cut off too: nobody was judged on silence it could not hear.
    assert sum(c.resumes for c in checks) == 0
    assert " lost: " not in mesh.daemon.output_tail(200_000)
