"""The SDK against a real uvicorn server running the API over the in-memory fake daemon: typed
results and errors, event streams that reconnect across a server restart, and the blocking
``SyncClient``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from anyio.from_thread import start_blocking_portal
from tests.fakes.fake_service import FakeService, free_port, serving

from apomesh import Client as LazyClient
from apomesh.api.app import create_app
from apomesh.api.auth import AuthSettings
from apomesh.api.tokens import TokenStore
from apomesh.core.events import AgentResumed, AgentResuming
from apomesh.core.views import PinDiff, SessionView
from apomesh.sdk import (
    Client,
    ConfirmationRequired,
    ConflictError,
    EventRecord,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    ServerUnavailable,
    SyncClient,
    UnauthorizedError,
)

WRITER = {"name": "writer", "version": "1.0.0", "instructions": "Write."}


def test_the_package_exports_the_client_lazily() -> None:
    assert LazyClient is Client


@pytest.mark.anyio
async def test_sessions_start_list_show_and_wait() -> None:
    fake = FakeService()
    async with serving(create_app(fake, auth=AuthSettings.off())) as url, Client(url) as client:
        inline = await client.start_session("write a haiku", definition=WRITER)
        await client.publish_agent(WRITER)
        published = await client.start_session("write a sonnet", agent="writer@1.0.0")
        assert fake.calls[-1][2] == ("writer", "1.0.0")
        view = await client.get_session(inline)
        assert isinstance(view, SessionView)
        assert (view.status, view.goal, view.agents[0].ref) == ("running", "write a haiku", "root")
        listed = await client.list_sessions()
        assert {s.session_id for s in listed} == {inline, published}
        assert [s.session_id for s in await client.list_sessions(query="sonnet")] == [published]
        assert await client.list_sessions(status="completed") == []

        async def finish() -> None:
            await anyio.sleep(0.2)
            await fake.spawn(inline, "root/0", "root", "first line")
            await fake.end(inline, output="an old silent pond")

        async with anyio.create_task_group() as group:
            group.start_soon(finish)
            with anyio.fail_after(20):
                done = await client.wait(inline)
        assert (done.status, done.output) == ("completed", "an old silent pond")
        assert done.terminal
        assert (await client.wait(inline)).status == "completed"  # already over: at once


@pytest.mark.anyio
async def test_events_are_typed_records_ending_after_session_ended() -> None:
    fake = FakeService()
    session_id = await fake.start()
    pause_id = await fake.pause(session_id, "root", "Which tone?")
    app = create_app(fake, auth=AuthSettings.off(), keepalive_seconds=0.05)
    async with serving(app) as url, Client(url) as client:
        records: list[EventRecord] = []

        async def follow() -> None:
            async for record in client.events(session_id):
                records.append(record)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(follow)
                while len(records) < 4:
                    await anyio.sleep(0.01)
                assert records[3].kind == "HitlPaused"
                assert records[3].event["question"] == "Which tone?"
                await client.answer_hitl(session_id, pause_id, "dry")
                await fake.end(session_id)
        assert [r.kind for r in records] == [
            "SessionStarted", "AgentLifecycle", "AgentLifecycle", "HitlPaused", "HitlAnswered",
            "SessionEnded",
        ]  # fmt: skip
        assert [r.index for r in records] == list(range(6))
        assert records[4].event == {"kind": "HitlAnswered", "pause_id": pause_id, "answer": "dry",
                                    "by": "operator"}  # fmt: skip
        assert all(r.session_id == session_id and r.event_id for r in records)
        later = [r.index async for r in client.events(session_id, after=3)]
        assert later == [4, 5]


@pytest.mark.anyio
async def test_events_reconnect_across_a_daemon_restart_without_loss_or_repeat() -> None:
    fake = FakeService()
    session_id = await fake.start()
    port = free_port()
    records: list[EventRecord] = []
    async with Client(f"http://127.0.0.1:{port}", reconnect_window=30) as client:

        async def follow() -> None:
            async for record in client.events(session_id):
                records.append(record)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                async with serving(create_app(fake, auth=AuthSettings.off()), port):
                    group.start_soon(follow)
                    while len(records) < 3:
                        await anyio.sleep(0.01)
                # The daemon is down: the session goes on being logged meanwhile (its log is
                # durable), and the client keeps trying to reconnect.
                await fake.spawn(session_id, "root/0", "root", "intro")
                await fake.emit(
                    session_id,
                    AgentResuming(agent="root/0", reason="worker lost", epoch=2),
                    AgentResumed(agent="root/0", epoch=2),
                )
                await anyio.sleep(0.5)
                assert len(records) == 3
                async with serving(create_app(fake, auth=AuthSettings.off()), port):
                    while len(records) < 6:
                        await anyio.sleep(0.01)
                    await fake.end(session_id)
                    while not records or records[-1].kind != "SessionEnded":
                        await anyio.sleep(0.01)
    assert [r.index for r in records] == list(range(7))
    assert [r.kind for r in records][3:] == [
        "AgentLifecycle", "AgentResuming", "AgentResumed", "SessionEnded",
    ]  # fmt: skip


@pytest.mark.anyio
async def test_errors_are_typed() -> None:
    fake = FakeService()
    session_id = await fake.start()
    fake.max_skill_bytes = 4
    async with serving(create_app(fake, auth=AuthSettings.off())) as url, Client(url) as client:
        with pytest.raises(NotFoundError) as missing:
            await client.get_session("nobody")
        assert (missing.value.status, missing.value.code) == (404, "not_found")
        with pytest.raises(NotFoundError):
            async for _ in client.events("nobody"):
                pass
        with pytest.raises(InvalidRequestError) as invalid:
            await client.start_session("g", definition={"name": "w", "budget": {"max_steps": "x"}})
        assert invalid.value.code == "invalid_definition"
        with pytest.raises(InvalidRequestError):
            await client.list_sessions(status="sleeping")
        await client.publish_agent(WRITER)
        with pytest.raises(ConflictError) as conflict:
            await client.publish_agent({**WRITER, "instructions": "Other."})
        assert conflict.value.code == "publish_conflict"
        with pytest.raises(PayloadTooLargeError):
            await client.put_skill("style", "too long")
        with pytest.raises(ConflictError):
            await client.resume(session_id)  # not recoverable
    with pytest.raises(ServerUnavailable) as down:
        async with Client(url) as client:
            await client.health()
    assert down.value.status == 0


@pytest.mark.anyio
async def test_events_give_up_after_the_reconnect_window() -> None:
    port = free_port()
    async with Client(f"http://127.0.0.1:{port}", reconnect_window=0.3) as client:
        with anyio.fail_after(20), pytest.raises(ServerUnavailable):
            async for _ in client.events("s1"):
                pass


@pytest.mark.anyio
async def test_recovery_catalog_and_workers_round_trip() -> None:
    fake = FakeService()
    session_id = await fake.start("send invoices")
    await fake.side_effect(
        session_id, "root", "fs.append", {"path": "out", "line": "x"}, recorded=False
    )
    fake.make_recoverable(session_id, pin_diff=[PinDiff(name="extra", old="1.0", new="1.1")])
    fake.add_worker("w1", "edge-1", [f"{session_id}/root"])
    async with serving(create_app(fake, auth=AuthSettings.off())) as url, Client(url) as client:
        [stranded] = await client.list_recoverable()
        assert (stranded.session_id, stranded.category) == (session_id, "side_effects")
        preview = await client.recovery_preview(session_id)
        assert [u.tool for u in preview.unknown_outcomes] == ["fs.append"]
        with pytest.raises(ConfirmationRequired) as asked:
            await client.resume(session_id, confirm=False)
        assert asked.value.preview == preview
        with pytest.raises(ConflictError) as pins:
            await client.resume(session_id)
        assert pins.value.code == "plugin_pin_mismatch"
        await client.resume(session_id, migrate_pins={"extra": "1.1"})
        assert (await client.get_session(session_id)).recoveries == 1
        assert await client.list_recoverable() == []

        [worker] = await client.list_workers()
        assert (worker.id, worker.name, worker.agents, worker.alive) == (
            "w1", "edge-1", [f"{session_id}/root"], True,
        )  # fmt: skip

        skill = await client.put_skill("house.style-2", "Be brief.")
        assert (skill.name, skill.revision) == ("house.style-2", 1)
        assert (await client.get_skill("house.style-2")).body == "Be brief."
        assert [s.name for s in await client.list_skills()] == ["house.style-2"]
        await client.delete_skill("house.style-2")
        with pytest.raises(NotFoundError):
            await client.get_skill("house.style-2")

        first = await client.publish_agent(WRITER)
        again = await client.publish_agent(WRITER)
        assert (first.created, again.created, first.agent) == (True, False, again.agent)
        await client.publish_agent({**WRITER, "version": "2.0.0"})
        assert [a.version for a in await client.list_agents()] == ["1.0.0", "2.0.0"]
        assert (await client.get_agent("writer")).version == "2.0.0"
        assert (await client.get_agent("writer", "1.0.0")).version == "1.0.0"

        await client.cancel(session_id)
        assert (await client.get_session(session_id)).status == "cancelled"
        assert (await client.health())["ok"] is True
        assert "apomesh_sessions" in await client.metrics()


@pytest.mark.anyio
async def test_tokens_are_sent_and_refusals_are_typed(tmp_path: Path) -> None:
    fake = FakeService()
    session_id = await fake.start()
    tokens = TokenStore.in_dir(tmp_path)
    _, reader = tokens.create("read", "dashboard")
    _, operator = tokens.create("operator", "alice")
    app = create_app(fake, auth=AuthSettings(enabled=True, token_store=tokens))
    async with serving(app) as url:
        async with Client(url) as anonymous:
            with pytest.raises(UnauthorizedError):
                await anonymous.get_session(session_id)
            with pytest.raises(UnauthorizedError):
                async for _ in anonymous.events(session_id):
                    pass
        async with Client(url, token=reader) as client:
            assert (await client.get_session(session_id)).session_id == session_id
            with pytest.raises(ForbiddenError):
                await client.cancel(session_id)
        async with Client(url, token=operator) as client:
            await client.cancel(session_id)
            assert [r.kind async for r in client.events(session_id)][-1] == "SessionEnded"
    assert fake.calls[-1] == ("cancel", session_id, "alice")


@pytest.fixture
def served_fake() -> Iterator[tuple[str, FakeService, object]]:
    """The fake daemon served from a background event loop, for blocking clients."""
    fake = FakeService()
    with start_blocking_portal(backend="asyncio") as portal:
        app = create_app(fake, auth=AuthSettings.off(), keepalive_seconds=0.05)
        with portal.wrap_async_context_manager(serving(app)) as url:
            yield url, fake, portal


def test_the_sync_client_offers_the_same_calls(
    served_fake: tuple[str, FakeService, object],
) -> None:
    url, fake, portal = served_fake
    call = portal.call  # type: ignore[attr-defined]
    with SyncClient(url) as client:
        session_id = client.start_session("write", definition=WRITER)
        assert client.get_session(session_id).status == "running"
        assert [s.session_id for s in client.list_sessions()] == [session_id]
        stream = client.events(session_id)
        assert [next(stream).index for _ in range(3)] == [0, 1, 2]
        call(fake.end, session_id)
        assert [r.kind for r in stream] == ["SessionEnded"]
        assert client.wait(session_id).status == "completed"
        with pytest.raises(NotFoundError):
            client.get_session("nobody")
        client.put_skill("style", "Be brief.")
        assert [s.name for s in client.list_skills()] == ["style"]
        assert client.health()["ok"] is True
        # Leaving an event iterator early releases it.
        other = client.start_session("again", definition=WRITER)
        for record in client.events(other):
            if record.index == 1:
                break
    with pytest.raises(RuntimeError):
        client.get_session(session_id)


@pytest.mark.anyio
async def test_a_read_whose_connection_is_closed_unanswered_is_sent_once_more() -> None:
    """A kept-alive connection the server closes as a request goes out: a GET is sent again on
    a new connection; a write is not (it may have been applied), and says the server dropped it."""
    answered: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        if not answered or len(answered) == 2:  # the first request, and the write, go unanswered
            answered.append(request)
            writer.close()
            return
        answered.append(request)
        body = b'{"daemons": []}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, Client(f"http://127.0.0.1:{port}") as client:
        assert await client.list_daemons() == []
        assert [r.split(b" ")[0] for r in answered] == [b"GET", b"GET"]
        with pytest.raises(ServerUnavailable, match="without sending a response"):
            await client.drain_daemon("d-1")
        assert len(answered) == 3
