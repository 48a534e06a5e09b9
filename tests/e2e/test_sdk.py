"""The Python SDK (``apomesh.Client`` and ``SyncClient``) against a real daemon on worker processes:
starting sessions (inline and published), typed views, tailing a session through a worker kill and
a daemon restart without a gap or a repeat, answering a pause, cancelling, listing and resuming a
recoverable session, listing workers, and the typed errors. Also the command-line paths that go
through the SDK for recovery and pauses (``apomesh recover``, ``apomesh hitl answer``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from tests.e2e.api_support import (
    ECHO,
    appender,
    asker,
    fanout_writer,
    journal_lines,
    slow_reader,
    start_mesh,
    stop_mesh,
    wait_until,
)

from apomesh.sdk import (
    AgentSummary,
    ApiError,
    Client,
    ConfirmationRequired,
    ConflictError,
    EventRecord,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    Published,
    RecoverableView,
    ServerUnavailable,
    SessionSummary,
    SessionView,
    SkillView,
    SyncClient,
    WorkerView,
)
from apomesh.testing import Mesh

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = start_mesh(tmp_path_factory.mktemp("sdk"))
    try:
        yield mesh
    finally:
        stop_mesh(mesh)


@pytest.fixture
def sync(system: Mesh) -> Iterator[SyncClient]:
    with SyncClient(system.url) as client:
        yield client


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "apomesh", *args, "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


# --- sessions, typed ------------------------------------------------------------------------------


async def test_sessions_start_inline_and_published_and_read_back_typed(system: Mesh) -> None:
    async with Client(system.url) as client:
        published = await client.publish_agent({**ECHO, "name": "sdk-echo"})
        assert isinstance(published, Published) and published.created
        assert published.agent.name == "sdk-echo" and published.agent.version == "1.0.0"
        again = await client.publish_agent({**ECHO, "name": "sdk-echo"})
        assert again.created is False and again.agent.digest == published.agent.digest
        assert "sdk-echo" in {a.name for a in await client.list_agents()}
        assert (await client.get_agent("sdk-echo")).digest == published.agent.digest

        inline = await client.start_session("inline hello", definition=ECHO)
        by_name = await client.start_session("published hello", agent="sdk-echo@1.0.0")
        for session_id, goal in ((inline, "inline hello"), (by_name, "published hello")):
            done = await client.wait(session_id, timeout=60)
            assert isinstance(done, SessionView)
            assert done.status == "completed" and done.terminal
            assert done.output == f"done: {goal}"
            assert all(isinstance(a, AgentSummary) for a in done.agents)
            assert done.agents[0].ref == "root" and done.agents[0].phase == "completed"
            state = await client.get_session(session_id)
            assert state == done
        rows = await client.list_sessions(query="hello")
        assert all(isinstance(r, SessionSummary) for r in rows)
        assert {inline, by_name} <= {r.session_id for r in rows}
        assert [r.session_id for r in await client.list_sessions(query=inline)] == [inline]


async def test_events_are_typed_records_and_end_after_session_ended(system: Mesh) -> None:
    async with Client(system.url) as client:
        session_id = await client.start_session("count events", definition=ECHO)
        records = [record async for record in client.events(session_id)]
        assert all(isinstance(r, EventRecord) for r in records)
        assert [r.index for r in records] == list(range(len(records)))
        assert records[0].kind == "SessionStarted" and records[-1].kind == "SessionEnded"
        assert all(r.session_id == session_id and r.event_id for r in records)
        tail = [r.index async for r in client.events(session_id, after=records[-3].index)]
        assert tail == [records[-2].index, records[-1].index]


def test_the_sync_client_does_the_same(sync: SyncClient) -> None:
    session_id = sync.start_session("sync hello", definition=ECHO)
    kinds = [record.kind for record in sync.events(session_id)]
    assert kinds[0] == "SessionStarted" and kinds[-1] == "SessionEnded"
    assert sync.get_session(session_id).output == "done: sync hello"
    assert sync.health()["ok"] is True
    assert "apomesh_events_appended_total" in sync.metrics()
    skill = sync.put_skill("sdk-style", "Be brief.")
    assert isinstance(skill, SkillView) and skill.body == "Be brief."
    assert sync.get_skill("sdk-style").digest == skill.digest
    assert "sdk-style" in {s.name for s in sync.list_skills()}
    sync.delete_skill("sdk-style")
    with pytest.raises(NotFoundError):
        sync.get_skill("sdk-style")


def test_workers_are_listed_typed(sync: SyncClient) -> None:
    workers = sync.list_workers()
    assert len(workers) == 2
    assert all(isinstance(w, WorkerView) and w.alive for w in workers)
    assert {w.name for w in workers} == {"w0", "w1"}
    assert all(w.last_heartbeat > 0 and "fs.append" in w.tools for w in workers)


# --- operator actions -----------------------------------------------------------------------------


async def test_a_pause_is_answered_from_the_event_stream(system: Mesh) -> None:
    async with Client(system.url) as client:
        session_id = await client.start_session("pick a colour", definition=asker("Green?"))
        answered = False
        kinds: list[str] = []
        async for record in client.events(session_id):
            kinds.append(record.kind)
            if record.kind == "HitlPaused":
                assert record.event["question"] == "Green?"
                assert (await client.get_session(session_id)).status == "paused"
                await client.answer_hitl(session_id, record.event["pause_id"], "Yes, green.")
                answered = True
                with pytest.raises(ConflictError) as again:
                    await client.answer_hitl(session_id, record.event["pause_id"], "Again.")
                assert again.value.code == "command_refused"
        assert answered and kinds[-1] == "SessionEnded"
        assert kinds.index("HitlAnswered") > kinds.index("HitlPaused")
        assert (await client.get_session(session_id)).status == "completed"


async def test_a_session_is_cancelled_once(system: Mesh) -> None:
    async with Client(system.url) as client:
        session_id = await client.start_session("never ends", definition=slow_reader(60, 0.1))
        async for record in client.events(session_id):
            if record.kind == "AgentSnapshotted":
                break
        await client.cancel(session_id)
        done = await client.wait(session_id, timeout=30)
        assert done.status == "cancelled"
        with pytest.raises(ConflictError) as refused:
            await client.cancel(session_id)
        assert refused.value.status == 409


async def test_errors_are_typed(system: Mesh) -> None:
    async with Client(system.url) as client:
        with pytest.raises(NotFoundError) as missing:
            await client.get_session("0" * 32)
        assert missing.value.status == 404 and missing.value.code == "not_found"
        with pytest.raises(NotFoundError):
            async for _ in client.events("0" * 32):
                pass
        with pytest.raises(InvalidRequestError) as invalid:
            await client.start_session("x", definition={**ECHO, "coordination": "telepathy"})
        assert invalid.value.code == "invalid_definition"
        assert "$.coordination" in invalid.value.message
        with pytest.raises(InvalidRequestError) as blank:
            await client.start_session("   ", definition=ECHO)
        assert blank.value.code == "invalid_body"
        with pytest.raises(PayloadTooLargeError):
            await client.put_skill("huge", "x" * (2 * 1024 * 1024))
        await client.publish_agent({**ECHO, "name": "sdk-fixed"})
        with pytest.raises(ConflictError) as conflict:
            await client.publish_agent({**ECHO, "name": "sdk-fixed", "instructions": "other"})
        assert conflict.value.code == "publish_conflict"
        with pytest.raises(NotFoundError):
            await client.recovery_preview("0" * 32)
        with pytest.raises(TimeoutError):
            slow = await client.start_session("slow", definition=slow_reader(40, 0.1))
            await client.wait(slow, timeout=0.5)
        await client.cancel(slow)
    async with Client("http://127.0.0.1:9", reconnect_window=0.5) as nowhere:
        with pytest.raises(ServerUnavailable) as down:
            await nowhere.health()
        assert down.value.status == 0
        with pytest.raises(ServerUnavailable):
            async for _ in nowhere.events("abc"):
                pass
    assert issubclass(ServerUnavailable, ApiError)


# --- through a worker kill and a daemon restart ----------------------------------------------------


async def test_a_tail_survives_a_worker_kill_and_a_daemon_restart_then_a_resume(
    mesh: Mesh,
) -> None:
    """One iterator follows a fanout session with side effects from start to end: a worker
    running a sub-agent is SIGKILLed (the agent resumes elsewhere), then the daemon is SIGKILLed
    and started again (the session waits on the recoverable list: it has side effects), and the
    SDK lists it, shows the preview, refuses to resume without confirmation and resumes it. No
    event is missed or repeated and no line is written twice."""
    records: list[EventRecord] = []
    resumed = anyio.Event()
    effect_seen = anyio.Event()

    async with Client(mesh.url, reconnect_window=90) as client:
        session_id = await client.start_session(
            "write three parts", definition=fanout_writer("sdk", steps=5)
        )

        async def tail() -> None:
            async for record in client.events(session_id):
                records.append(record)
                if record.kind == "ToolCallRecorded" and "/" in record.event["agent"]:
                    effect_seen.set()
                if record.kind == "AgentResumed":
                    resumed.set()

        with anyio.fail_after(150):
            async with anyio.create_task_group() as group:
                group.start_soon(tail)
                await effect_seen.wait()
                agent = next(r for r in records if r.kind == "ToolCallRecorded").event["agent"]
                view = await client.get_session(session_id)
                worker_id = next(a.worker for a in view.agents if a.ref == agent)
                names = {w.id: w.name for w in await client.list_workers()}
                victim = next(w for w in mesh.workers if w.name == names[worker_id])
                await anyio.to_thread.run_sync(victim.kill)
                await anyio.to_thread.run_sync(mesh.worker)
                await resumed.wait()

                await anyio.to_thread.run_sync(mesh.daemon.kill)
                await anyio.to_thread.run_sync(mesh.daemon.start)
                stranded = await client.list_recoverable()
                assert [r.session_id for r in stranded] == [session_id]
                assert isinstance(stranded[0], RecoverableView)
                assert stranded[0].side_effects >= 1
                preview = await client.recovery_preview(session_id)
                assert preview.reason == stranded[0].reason and preview.pin_diff == []
                assert (await client.get_session(session_id)).status == "recoverable"
                with pytest.raises(ConfirmationRequired) as unconfirmed:
                    await client.resume(session_id, confirm=False)
                assert unconfirmed.value.preview.session_id == session_id
                await client.resume(session_id)

        done = await client.get_session(session_id)
    assert done.status == "completed", done
    indexes = [r.index for r in records]
    assert indexes == list(range(len(indexes))), indexes
    kinds = [r.kind for r in records]
    assert kinds[-1] == "SessionEnded"
    first_resuming = kinds.index("AgentResuming")
    assert kinds.index("AgentResumed") > first_resuming
    assert "OperatorAction" in kinds and "SessionRecovered" in kinds
    assert done.recoveries >= 1 and done.resumes >= 1
    for index in range(3):
        lines = journal_lines(mesh.daemon.workspace / session_id, f"sdk-{index}.txt")
        assert len(lines) == len(set(lines)), lines


# --- the command line, through the SDK -------------------------------------------------------------


def test_cli_answers_a_pause(system: Mesh, sync: SyncClient) -> None:
    session_id = sync.start_session("ask on the command line", definition=asker("Tea?"))
    pause = wait_until(lambda: sync.get_session(session_id).hitl_pending, 30, "the pause")[0]
    answered = cli(system.url, "hitl", "answer", session_id, pause.pause_id, "Tea, please.")
    assert answered.returncode == 0, answered.stderr
    assert sync.wait(session_id, timeout=30).status == "completed"
    again = cli(system.url, "hitl", "answer", session_id, pause.pause_id, "Coffee.")
    assert again.returncode == 1
    assert "command_refused" in again.stderr


def test_cli_lists_and_resumes_a_recoverable_session(mesh: Mesh) -> None:
    with SyncClient(mesh.url) as client:
        session_id = client.start_session(
            "append on the command line", definition=appender("cli.txt")
        )
        for record in client.events(session_id):
            if record.kind == "ToolCallRecorded":
                break
        mesh.daemon.kill()
        mesh.daemon.start()
        listed = cli(mesh.url, "recover", "list")
        assert listed.returncode == 0, listed.stderr
        assert session_id in listed.stdout
        # Without a terminal to ask and without --yes it refuses (it never resumes silently).
        refused = cli(mesh.url, "recover", "resume", session_id)
        assert refused.returncode == 2 and "pass --yes" in refused.stderr
        assert session_id in {r.session_id for r in client.list_recoverable()}
        resumed = cli(mesh.url, "recover", "resume", session_id, "--yes")
        assert resumed.returncode == 0, resumed.stderr
        assert f"resumed {session_id}" in " ".join(resumed.stdout.split())
        assert client.wait(session_id, timeout=60).status == "completed"
        assert client.list_recoverable() == []
    again = cli(mesh.url, "recover", "resume", session_id, "--yes")
    assert again.returncode == 1
    lines = journal_lines(mesh.daemon.workspace / session_id, "cli.txt")
    assert len(lines) == len(set(lines)) >= 5
    down = subprocess.run(
        [sys.executable, "-m", "apomesh", "recover", "list", "--url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1


def test_a_daemon_restart_is_invisible_to_a_sync_iterator(mesh: Mesh) -> None:
    with SyncClient(mesh.url) as client:
        session_id = client.start_session("read on", definition=slow_reader(8, 0.3))
        indexes: list[int] = []
        restarted = False
        for record in client.events(session_id):
            indexes.append(record.index)
            if record.kind == "AgentSnapshotted" and not restarted:
                restarted = True
                mesh.daemon.kill()
                mesh.daemon.start()
        assert restarted
        assert indexes == list(range(len(indexes)))
        assert client.get_session(session_id).status == "completed"
    assert httpx.get(f"{mesh.url}/healthz").json()["ok"] is True
    assert Path(mesh.daemon.log_file).exists()
