"""Several daemons on one NATS cluster: presence, ownership, takeover and drain, with real
processes. A three-node nats-server cluster (three-replica streams), ``apomesh serve`` processes
with their own data dirs and shared ``apomesh worker`` processes.

- A daemon SIGKILLed mid-run (its data dir deleted): its peers adopt every session within the
  lease TTL, exactly one of them each (the lease decides the race), and finish them with every
  side effect exactly once; an event stream opened on the dead daemon continues on a peer with
  no gap and no duplicate.
- Reads of a session work on any daemon and name its owner; a write sent to a daemon that does
  not own the session is refused with ``owned_by_another_daemon`` naming the owner.
- A daemon frozen past its lease (SIGSTOP: its presence record ages out) is superseded: a peer drives the session, and what
  the stale daemon tries to write when it thaws is rejected by the log.
- ``apomesh daemons drain ID`` moves a daemon's sessions to a peer at node boundaries with no
  unknown outcome; ``apomesh daemons list --json`` shows it drained.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from tests.browser import by_testid, wait_for
from tests.e2e.chaos_audit import audit_session
from tests.e2e.chaos_kit import appender, check_session, fresh_solo
from tests.fakes.fresh_model import FreshModelServer, fresh_model_config, fresh_model_env

from apomesh.adapters.natsserver import NatsCluster
from apomesh.sdk.client import Client, ConflictError, EventRecord
from apomesh.testing import DaemonProcess, WorkerProcess

pytestmark = pytest.mark.anyio

SHOTS = Path(os.environ.get("APOMESH_SHOTS", "/tmp"))
LEASE_TTL = 3.0
"""A short lease so a takeover happens within seconds (the default is 30 s)."""
DEADLINE = 120.0


class Daemons:
    """Daemons and workers on one cluster; everything stops at teardown."""

    def __init__(self, cluster: NatsCluster, base: Path) -> None:
        self.urls = [s.url for s in cluster]
        self.cluster = cluster
        self.base = base
        self.workspace = base / "workspace"
        self.daemons: list[DaemonProcess] = []
        self.workers: list[WorkerProcess] = []
        self.model_config: Path | None = None
        self.env: dict[str, str] = {}

    def use_fresh_model(self, base_url: str) -> None:
        """Daemons and workers started from now on answer through the fresh-model server."""
        self.model_config = self.base / "fresh-model.toml"
        self.model_config.write_text(fresh_model_config(base_url))
        self.env = fresh_model_env()

    def daemon(self, name: str) -> DaemonProcess:
        config = ("--config", str(self.model_config)) if self.model_config else ()
        daemon = DaemonProcess(
            self.urls,
            self.base / name,
            extra_args=("--replicas", "3", *config),
            env={"APOMESH_DAEMON_LEASE_TTL": str(LEASE_TTL), **self.env},
        )
        daemon.start(timeout=60.0)
        self.daemons.append(daemon)
        return daemon

    def worker(self, name: str) -> WorkerProcess:
        worker = WorkerProcess(
            self.urls, self.workspace, name, env=self.env, config=self.model_config
        )
        worker.start()
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        for daemon in self.daemons:
            daemon.stop()


@pytest.fixture
def system(nats_cluster: NatsCluster, tmp_path: Path) -> Iterator[Daemons]:
    daemons = Daemons(nats_cluster, tmp_path)
    try:
        yield daemons
    finally:
        daemons.close()


async def daemon_id(url: str) -> str:
    """The id of the daemon at ``url``, once its own presence record is published."""
    async with Client(url) as client:
        with anyio.fail_after(DEADLINE):
            while True:
                mine = [d.id for d in await client.list_daemons() if d.this]
                if mine:
                    return mine[0]
                await anyio.sleep(0.1)


async def wait_daemons(*daemons: DaemonProcess) -> None:
    """Until the first daemon lists every one of ``daemons`` active and sees two live workers
    (records of earlier tests' daemons may linger in the shared cluster until they age out)."""
    ids = {await daemon_id(d.url) for d in daemons}
    async with Client(daemons[0].url) as client:
        with anyio.fail_after(DEADLINE):
            while True:
                active = {d.id for d in await client.list_daemons() if d.state == "active"}
                workers = [w for w in await client.list_workers() if w.alive]
                if ids <= active and len(workers) >= 2:
                    return
                await anyio.sleep(0.1)


async def two_daemons(system: Daemons) -> tuple[DaemonProcess, DaemonProcess]:
    """Daemons A and B over two shared workers, once A lists both daemons and both workers."""
    a = system.daemon("a")
    b = system.daemon("b")
    system.worker("w1")
    system.worker("w2")
    await wait_daemons(a, b)
    return a, b


async def wait_side_effects(client: Client, session_ids: list[str], count: int) -> None:
    with anyio.fail_after(DEADLINE):
        for session_id in session_ids:
            while (await client.get_session(session_id)).side_effects < count:
                await anyio.sleep(0.05)


async def all_events(url: str, session_id: str) -> list[EventRecord]:
    """The session's whole log through the daemon at ``url``, once it has ended."""
    async with Client(url) as client:
        with anyio.fail_after(DEADLINE):
            return [record async for record in client.events(session_id)]


async def start_sessions(url: str, goals: list[str], steps: int) -> list[str]:
    async with Client(url) as client:
        return [
            await client.start_session(goal, definition=appender(steps=steps, delay=0.3))
            for goal in goals
        ]


def assert_exactly_once(records: list[EventRecord], workspace: Path) -> None:
    # The daemon's own verification compares the log with its store, which holds only the
    # snapshots it wrote itself: after a takeover the invariants are checked from the log and
    # the workspace alone.
    check = check_session(records, {"ok": True}, workspace)
    assert check.ok, check.problems
    assert check.status == "completed"


async def test_a_second_daemon_started_mid_run_leaves_the_first_ones_sessions_running(
    system: Daemons,
) -> None:
    a = system.daemon("a")
    system.worker("w1")
    system.worker("w2")
    await wait_daemons(a)
    a_id = await daemon_id(a.url)
    session_ids = await start_sessions(a.url, [f"second-{n}" for n in range(2)], steps=40)
    async with Client(a.url) as on_a:
        await wait_side_effects(on_a, session_ids, 1)
    b = system.daemon("b")
    async with Client(b.url) as on_b:
        # B's boot scan leaves A's sessions alone: it reads them and names their owner.
        for session_id in session_ids:
            view = await on_b.get_session(session_id)
            assert view.status == "running" and view.owner == a_id
        assert (await on_b.health())["boot"]["owned_by_peers"] == len(session_ids)
    for session_id in session_ids:
        # Followed live through B, which does not drive it.
        log = await all_events(b.url, session_id)
        assert_exactly_once(log, system.workspace)
        # Driven by A from start to end: never recovered, no agent re-dispatched.
        assert not any(r.kind in ("SessionRecovered", "AgentResuming") for r in log)


async def test_a_killed_daemons_sessions_finish_on_one_peer_each_exactly_once(
    system: Daemons,
) -> None:
    a = system.daemon("a")
    b = system.daemon("b")
    c = system.daemon("c")
    system.worker("w1")
    system.worker("w2")
    await wait_daemons(a, b, c)
    a_id, b_id, c_id = [await daemon_id(d.url) for d in (a, b, c)]
    session_ids = await start_sessions(a.url, [f"kill-{n}" for n in range(3)], steps=20)

    # A tail opened on A, given the peers to fail over to.
    tailed: list[EventRecord] = []

    async def tail() -> None:
        async with Client(f"{a.url},{b.url},{c.url}", reconnect_window=DEADLINE) as client:
            async for record in client.events(session_ids[0]):
                tailed.append(record)

    with anyio.fail_after(DEADLINE * 2):
        async with anyio.create_task_group() as group:
            group.start_soon(tail)
            records = await kill_a_midrun(a, b, session_ids, a_id, b_id)
    await check_takeover(system, records, session_ids, tailed, (a_id, b_id, c_id), b.url)


async def kill_a_midrun(
    a: DaemonProcess, b: DaemonProcess, session_ids: list[str], a_id: str, b_id: str
) -> dict[str, list[EventRecord]]:
    async with Client(a.url) as on_a, Client(b.url) as on_b:
        await wait_side_effects(on_a, session_ids, 2)
        # Any daemon reads any session, and names its owner.
        view = await on_b.get_session(session_ids[0])
        assert view.owner == a_id and view.status == "running"
        # A write sent to a daemon that does not own the session is refused, naming the owner.
        with pytest.raises(ConflictError) as refused:
            await on_b.cancel(session_ids[0])
        assert refused.value.code == "owned_by_another_daemon"
        assert a_id in str(refused.value)
        assert a.url in str(refused.value)
        rows = {d.id: d for d in await on_b.list_daemons()}
        assert rows[a_id].sessions == 3 and rows[b_id].sessions == 0

    a.kill()
    shutil.rmtree(a.data_dir)

    return {sid: await all_events(b.url, sid) for sid in session_ids}


async def check_takeover(
    system: Daemons,
    records: dict[str, list[EventRecord]],
    session_ids: list[str],
    tailed: list[EventRecord],
    ids: tuple[str, str, str],
    url: str,
) -> None:
    a_id, b_id, c_id = ids
    for session_id, log in records.items():
        assert_exactly_once(log, system.workspace)
        recovered = [r for r in log if r.kind == "SessionRecovered"]
        assert len(recovered) == 1, f"{session_id} was adopted {len(recovered)} times"
        assert not any(r.kind == "OperatorAction" for r in log)
    # Each session was adopted by exactly one of the two peers, under its own agent refs.
    async with Client(url) as on_b:
        owners = {d.id for d in await on_b.list_daemons()}
    assert a_id not in owners and {b_id, c_id} <= owners
    # The tail opened on A went on through a peer: the whole log, no gap, no duplicate.
    assert [r.index for r in tailed] == [r.index for r in records[session_ids[0]]]
    assert [r.event_id for r in tailed] == [r.event_id for r in records[session_ids[0]]]


async def test_fresh_model_sessions_of_a_killed_daemon_finish_on_its_peer_audited_clean(
    system: Daemons,
) -> None:
    """The same takeover with a model that never repeats itself: what the dead daemon's agents
    were told is served to the peer (recorded turns), never asked again."""
    with FreshModelServer() as server:
        system.use_fresh_model(server.base_url)
        a, b = await two_daemons(system)
        async with Client(a.url) as on_a:
            session_ids = [
                await on_a.start_session(
                    f"fresh-{n}", definition=fresh_solo(server.model, appends=4)
                )
                for n in range(2)
            ]
            await wait_side_effects(on_a, session_ids, 1)
        a.kill()
        shutil.rmtree(a.data_dir)
        records = {sid: await all_events(b.url, sid) for sid in session_ids}
        calls = server.log()
    for session_id, log in records.items():
        audit = audit_session(log, None, system.workspace, calls, session_id=session_id)
        assert audit.ok, audit.problems
        assert audit.status == "completed"


async def test_two_daemons_across_nats_frozen_longer_than_a_lease_finish_exactly_once(
    system: Daemons,
) -> None:
    """Every node of the cluster frozen (SIGSTOP) for four times the lease TTL under two daemons'
    fresh-model sessions: every presence record and lease ages past its TTL while nobody can
    renew it. Once the nodes run again no daemon may take its live peer's sessions for gone
    ones and run their effects again: every session completes exactly once, with no operator."""
    with FreshModelServer() as server:
        system.use_fresh_model(server.base_url)
        a, b = await two_daemons(system)
        started: dict[str, str] = {}
        for daemon in (a, b):
            async with Client(daemon.url) as client:
                for n in range(2):
                    definition = fresh_solo(server.model, appends=4)
                    sid = await client.start_session(
                        f"freeze-{daemon.data_dir.name}-{n}", definition=definition
                    )
                    started[sid] = daemon.url
        async with Client(a.url) as on_a:
            await wait_side_effects(on_a, list(started), 1)
        pids = [s.pid for s in system.cluster if s.pid is not None]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            await anyio.sleep(4 * LEASE_TTL)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        records = {sid: await all_events(url, sid) for sid, url in started.items()}
        calls = server.log()
        async with Client(a.url) as on_a:
            waiting = {r.session_id for r in await on_a.list_recoverable()}
    for session_id, log in records.items():
        audit = audit_session(log, None, system.workspace, calls, session_id=session_id)
        assert audit.ok, (session_id, audit.problems)
        assert audit.status == "completed"
    assert not waiting & set(started)


async def test_a_session_waiting_for_an_operator_on_a_lost_daemon_waits_on_its_peer(
    system: Daemons,
) -> None:
    # A lease TTL longer than a restart of A: A's own boot scan, not B's takeover, sees the crash.
    system.env["APOMESH_DAEMON_LEASE_TTL"] = "10"
    a, b = await two_daemons(system)
    (session_id,) = await start_sessions(a.url, ["stranded-then-lost"], steps=8)
    async with Client(a.url) as on_a:
        await wait_side_effects(on_a, [session_id], 1)
    # A crashes and restarts: a side effect is logged, so the session waits for an operator on A.
    # A's presence record names it by the time A answers (A's boot writes it before A is up), so
    # A may die again the moment it lists it.
    a.kill()
    a.start(timeout=60.0)
    async with Client(a.url) as on_a, Client(b.url) as on_b:
        with anyio.fail_after(DEADLINE):
            while session_id not in {r.session_id for r in await on_a.list_recoverable()}:
                await anyio.sleep(0.1)
        assert session_id not in {r.session_id for r in await on_b.list_recoverable()}
    # A is lost for good, data dir and all: once its presence ages out, B lists the session.
    a.kill()
    shutil.rmtree(a.data_dir)
    async with Client(b.url) as on_b:
        with anyio.fail_after(DEADLINE):
            while True:
                listed = {r.session_id: r for r in await on_b.list_recoverable()}
                if session_id in listed:
                    break
                await anyio.sleep(0.2)
        assert listed[session_id].side_effects >= 1
        assert "which is gone" in listed[session_id].reason
        await on_b.resume(session_id)
    records = await all_events(b.url, session_id)
    assert_exactly_once(records, system.workspace)
    assert [r.event["path"] for r in records if r.kind == "SessionRecovered"] == ["operator"]


async def test_a_frozen_daemons_session_moves_and_its_stale_writes_are_rejected(
    system: Daemons,
) -> None:
    a, b = await two_daemons(system)
    b_id = await daemon_id(b.url)
    [session_id] = await start_sessions(a.url, ["frozen"], steps=20)
    async with Client(a.url) as on_a:
        await wait_side_effects(on_a, [session_id], 2)
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        async with Client(b.url) as on_b:
            with anyio.fail_after(DEADLINE):
                while (await on_b.get_session(session_id)).owner != b_id:
                    await anyio.sleep(0.1)
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    log = await all_events(b.url, session_id)
    assert_exactly_once(log, system.workspace)
    # The thawed daemon stopped driving it: it owns nothing, and it still answers reads.
    async with Client(a.url) as on_a:
        with anyio.fail_after(DEADLINE):
            while True:
                rows = {d.id: d for d in await on_a.list_daemons()}
                if rows[await daemon_id(a.url)].sessions == 0:
                    break
                await anyio.sleep(0.1)
        assert (await on_a.get_session(session_id)).status == "completed"
    # Whichever it met first on waking: the lease change to the peer (it follows the lease
    # bucket), or its append rejected by the log's expected sequence; it stopped driving it.
    said = a.output_tail(400_000)
    assert f"is held by {b_id}" in said or "another writer appended" in said
    assert "this daemon stops driving it" in said


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "apomesh", *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        env={**os.environ, "APOMESH_TOKEN": "", "COLUMNS": "240"},
    )


async def two_daemons_running(
    system: Daemons, prefix: str
) -> tuple[DaemonProcess, DaemonProcess, str, str, list[str]]:
    """Daemons A and B over two shared workers, and two long sessions on A past a side effect."""
    a, b = await two_daemons(system)
    a_id, b_id = await daemon_id(a.url), await daemon_id(b.url)
    session_ids = await start_sessions(a.url, [f"{prefix}-{n}" for n in range(2)], steps=30)
    async with Client(a.url) as on_a:
        await wait_side_effects(on_a, session_ids, 1)
    return a, b, a_id, b_id, session_ids


async def test_drain_moves_a_daemons_sessions_to_its_peer_with_no_unknown_outcome(
    system: Daemons,
) -> None:
    a, b, a_id, b_id, session_ids = await two_daemons_running(system, "drain")

    listed = await anyio.to_thread.run_sync(lambda: cli("daemons", "list", "--url", a.url))
    assert listed.returncode == 0, listed.stderr
    assert a_id in listed.stdout and b_id in listed.stdout

    drained = await anyio.to_thread.run_sync(
        lambda: cli("daemons", "drain", a_id, "--url", b.url, "--wait", "60")
    )
    assert drained.returncode == 0, drained.stdout + drained.stderr
    async with Client(b.url) as on_b:
        # Handed over, not left to expire: A gave the leases back once drained.
        for session_id in session_ids:
            owner = (await on_b.get_session(session_id)).owner
            assert owner != a_id, a.output_tail(400_000)[-4000:]

    for session_id in session_ids:
        log = await all_events(b.url, session_id)
        assert_exactly_once(log, system.workspace)
        kinds = [r.kind for r in log]
        assert "SessionSuspended" in kinds
        assert not any(
            r.kind == "ToolCallRecorded" and r.event["outcome"] == "unknown" for r in log
        )
        recovered = [r for r in log if r.kind == "SessionRecovered"]
        assert len(recovered) == 1
    rows = json.loads(
        (
            await anyio.to_thread.run_sync(lambda: cli("daemons", "list", "--json", "--url", a.url))
        ).stdout
    )
    states = {row["id"]: row["state"] for row in rows}
    assert states[a_id] == "drained" and states[b_id] == "active"
    # A drained daemon places no new session; its peer does, and owns it.
    async with Client(a.url) as on_a, Client(b.url) as on_b:
        with pytest.raises(Exception) as refused:
            await on_a.start_session("late", definition=appender(steps=1))
        assert "daemon_draining" in str(refused.value) or "draining" in str(refused.value)
        new = await on_b.start_session("placed", definition=appender(steps=8, delay=0.3))
        assert (await on_a.get_session(new)).owner == b_id


async def test_sigterm_with_a_live_peer_hands_the_sessions_over(system: Daemons) -> None:
    # A lease and presence TTL well past the shutdown: a session B owns right after A exits was
    # handed over, not taken after its lease expired; and a loaded machine delaying B's presence
    # renewal by a second or two does not make A believe it has no live peer.
    system.env["APOMESH_DAEMON_LEASE_TTL"] = "30"
    a, b, a_id, b_id, session_ids = await two_daemons_running(system, "term")
    await anyio.to_thread.run_sync(a.stop)
    assert a.proc is not None and a.proc.returncode == 0, a.output_tail()
    async with Client(b.url) as on_b:
        # Handed over, not left to expire: A gave the leases back before it exited.
        for session_id in session_ids:
            assert (await on_b.get_session(session_id)).owner != a_id
        for session_id in session_ids:
            log = await all_events(b.url, session_id)
            assert_exactly_once(log, system.workspace)
            assert "SessionSuspended" in [r.kind for r in log]
            assert not any(
                r.kind == "ToolCallRecorded" and r.event["outcome"] == "unknown" for r in log
            )
            assert len([r for r in log if r.kind == "SessionRecovered"]) == 1
        assert {d.id for d in await on_b.list_daemons() if d.state == "active"} == {b_id}


async def test_the_console_lists_the_daemons_with_their_sessions(
    system: Daemons, page: Any
) -> None:
    a, b = await two_daemons(system)
    a_id, b_id = await daemon_id(a.url), await daemon_id(b.url)
    await start_sessions(b.url, ["console-0", "console-1"], steps=20)
    await page.goto(f"{a.url}/#/daemons")
    await wait_for(page, by_testid("daemon-row", daemon_id=a_id, this="true"))
    row = await wait_for(page, by_testid("daemon-row", daemon_id=b_id, state="active"))
    cells = by_testid("daemon-row", daemon_id=b_id) + " " + by_testid("daemon-sessions")
    with anyio.fail_after(DEADLINE):
        while (await page.text_content(cells)) != "2":
            await anyio.sleep(0.1)
    assert b.url in (await row.text_content())
    await page.screenshot(path=str(SHOTS / "console-daemons.png"), full_page=True)
