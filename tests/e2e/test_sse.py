"""A session's event stream (``GET /v1/sessions/{id}/events``) from a real daemon: ids are log
indexes, ``Last-Event-ID`` and ``?after=`` resume exactly after, keep-alive comments flow, the
stream ends after ``SessionEnded``; the ids continue without a gap or a repeat when the daemon is
SIGKILLed and restarted mid-stream, and a client reconnecting in the middle of an
``AgentResuming``/``AgentResumed`` pair (its worker SIGKILLed) sees both."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from tests.e2e.api_support import (
    ECHO,
    KEEPALIVE_SECONDS,
    SseItem,
    fanout_writer,
    slow_reader,
    sse,
    start,
    start_mesh,
    stop_mesh,
    view,
    wait_status,
    wait_until,
)

from apomesh.sdk import Client, EventRecord
from apomesh.testing import Mesh


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = start_mesh(tmp_path_factory.mktemp("sse"))
    try:
        yield mesh
    finally:
        stop_mesh(mesh)


@pytest.fixture(scope="module")
def finished(system: Mesh) -> tuple[str, int]:
    """A completed session and its last index."""
    session_id = start(system.url, "one short answer", ECHO)
    done = wait_status(system.url, session_id)
    assert done["status"] == "completed"
    return session_id, int(done["last_index"])


def frames(url: str, session_id: str, **options: Any) -> list[SseItem]:
    with httpx.Client(timeout=httpx.Timeout(30, read=60)) as client:
        return [item for item in sse(client, url, session_id, **options) if item.comment is None]


def test_ids_are_the_log_indexes_and_the_stream_ends_after_session_ended(
    system: Mesh, finished: tuple[str, int]
) -> None:
    session_id, last = finished
    items = frames(system.url, session_id)
    assert [int(f.id or "") for f in items] == list(range(last + 1))
    for item in items:
        assert item.data is not None
        assert item.data["index"] == int(item.id or "")
        assert item.data["session_id"] == session_id
        assert item.data["kind"] == item.event == item.data["event"]["kind"]
        assert item.data["v"] == 1 and item.data["event_id"] and item.data["ts"] > 0
    assert items[0].event == "SessionStarted"
    assert items[0].data is not None and items[0].data["event"]["goal"] == "one short answer"
    assert items[-1].event == "SessionEnded"
    assert items[-1].data is not None and items[-1].data["event"]["status"] == "completed"
    # Each envelope as the stream sends it is the one the log holds, byte for byte in meaning.
    again = frames(system.url, session_id)
    assert [f.data for f in again] == [f.data for f in items]


def test_last_event_id_and_after_resume_exactly_after(
    system: Mesh, finished: tuple[str, int]
) -> None:
    session_id, last = finished
    for position in range(-1, last + 1):
        by_header = frames(system.url, session_id, headers={"Last-Event-ID": str(position)})
        assert [int(f.id or "") for f in by_header] == list(range(position + 1, last + 1))
        by_query = frames(system.url, session_id, params={"after": str(position)})
        assert [f.data for f in by_query] == [f.data for f in by_header]
    # The header wins over the query, as browsers resend the header on their own.
    both = frames(
        system.url, session_id, headers={"Last-Event-ID": str(last - 1)}, params={"after": "0"}
    )
    assert [int(f.id or "") for f in both] == [last]
    # At or past the end: the stream ends at once, empty.
    assert frames(system.url, session_id, headers={"Last-Event-ID": str(last + 5)}) == []
    for bad in ("seven", "-2", "1.5"):
        response = httpx.get(
            f"{system.url}/v1/sessions/{session_id}/events", headers={"Last-Event-ID": bad}
        )
        assert response.status_code == 400, bad
        assert response.json()["error"] == "invalid_query"
        response = httpx.get(f"{system.url}/v1/sessions/{session_id}/events", params={"after": bad})
        assert response.status_code == 400, bad


def test_a_live_stream_follows_the_session_with_keep_alives_until_it_ends(system: Mesh) -> None:
    # Model turns slower than the keep-alive period: the stream is idle between events.
    session_id = start(system.url, "read slowly", slow_reader(turns=3, delay=KEEPALIVE_SECONDS * 3))
    ids: list[int] = []
    comments: list[str] = []
    with httpx.Client(timeout=httpx.Timeout(30, read=30)) as client:
        for item in sse(client, system.url, session_id):
            if item.comment is not None:
                comments.append(item.comment)
            else:
                ids.append(int(item.id or ""))
                last_kind = item.event
    assert last_kind == "SessionEnded"
    assert ids == list(range(len(ids)))
    assert "keep-alive" in comments
    assert view(system.url, session_id)["last_index"] == ids[-1]


def test_a_reader_that_leaves_early_does_not_disturb_the_session(system: Mesh) -> None:
    session_id = start(system.url, "read a little", slow_reader(turns=6, delay=0.2))
    with httpx.Client(timeout=30) as client:
        for item in sse(client, system.url, session_id):
            if item.event == "AgentSnapshotted":
                break
    assert wait_status(system.url, session_id)["status"] == "completed"
    assert frames(system.url, session_id)[-1].event == "SessionEnded"


# --- across a daemon restart ----------------------------------------------------------------


@pytest.mark.anyio
async def test_ids_continue_without_gap_or_repeat_when_the_daemon_restarts_mid_stream(
    mesh: Mesh,
) -> None:
    """The SDK's iterator reconnects by itself with ``Last-Event-ID`` while the daemon is killed
    and started again; the session (no side effects) is resumed by the new daemon."""
    session_id = start(mesh.url, "read through a restart", slow_reader(turns=10, delay=0.3))
    records: list[EventRecord] = []
    seen_snapshot = anyio.Event()

    async def tail() -> None:
        async with Client(mesh.url, reconnect_window=60) as client:
            async for record in client.events(session_id):
                records.append(record)
                if record.kind == "AgentSnapshotted" and not seen_snapshot.is_set():
                    seen_snapshot.set()

    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            group.start_soon(tail)
            await seen_snapshot.wait()
            cut_at = len(records)
            await anyio.to_thread.run_sync(mesh.daemon.kill)
            await anyio.sleep(0.5)  # the client fails to reconnect for a while
            await anyio.to_thread.run_sync(mesh.daemon.start)

    indexes = [r.index for r in records]
    assert indexes == list(range(len(indexes))), indexes
    kinds = [r.kind for r in records]
    assert kinds[-1] == "SessionEnded"
    assert records[-1].event["status"] == "completed"
    assert "SessionRecovered" in kinds[cut_at:]
    recovered = records[kinds.index("SessionRecovered")]
    assert recovered.event["path"] == "auto"
    assert 'apomesh_resumes_total{path="auto"} 1' in httpx.get(f"{mesh.url}/metrics").text
    # What the iterator saw is exactly the log, as a fresh reader sees it after the fact.
    replay = frames(mesh.url, session_id)
    assert [f.data["event_id"] for f in replay if f.data] == [r.event_id for r in records]


def test_a_raw_stream_cut_by_a_daemon_kill_resumes_from_last_event_id(mesh: Mesh) -> None:
    session_id = start(mesh.url, "read through a kill", slow_reader(turns=8, delay=0.3))
    seen: list[int] = []
    with httpx.Client(timeout=httpx.Timeout(30, read=30)) as client:
        killer: threading.Thread | None = None
        try:
            for item in sse(client, mesh.url, session_id):
                if item.id is None:
                    continue
                seen.append(int(item.id))
                if item.event == "AgentSnapshotted" and killer is None:
                    killer = threading.Thread(target=mesh.daemon.kill)
                    killer.start()
        except httpx.TransportError:
            pass  # a cut stream: the daemon died while the response was open
        assert killer is not None
        killer.join()
        assert seen and seen == list(range(len(seen)))
        mesh.daemon.start()
        for item in sse(client, mesh.url, session_id, headers={"Last-Event-ID": str(seen[-1])}):
            if item.id is not None:
                seen.append(int(item.id))
                last_kind = item.event
    assert last_kind == "SessionEnded"
    assert seen == list(range(len(seen)))


# --- in the middle of an agent resume ------------------------------------------------------------


def test_a_reconnect_in_the_middle_of_a_resume_sees_both_events(mesh: Mesh) -> None:
    """A worker running a sub-agent is SIGKILLed: a client that read up to ``AgentResuming``
    and reconnects gets ``AgentResumed``; one that reconnects from before gets both."""
    session_id = start(mesh.url, "write three parts", fanout_writer("pair"))
    names = {w["id"]: w["name"] for w in httpx.get(f"{mesh.url}/v1/workers").json()["workers"]}
    resuming: dict[str, Any] | None = None
    with httpx.Client(timeout=httpx.Timeout(30, read=60)) as client:
        for item in sse(client, mesh.url, session_id):
            data = item.data
            if data is None:
                continue
            child_effect = data["kind"] == "ToolCallRecorded" and "/" in data["event"]["agent"]
            if child_effect and not any(w.proc.poll() is not None for w in mesh.workers):
                agent = data["event"]["agent"]
                worker_id = next(
                    a["worker"] for a in view(mesh.url, session_id)["agents"] if a["ref"] == agent
                )
                next(w for w in mesh.workers if w.name == names[worker_id]).kill()
                mesh.worker()
            if data["kind"] == "AgentResuming":
                resuming = data
                break  # the reader goes away between the pair
    assert resuming is not None
    agent, at = resuming["event"]["agent"], resuming["index"]
    assert "lost" in resuming["event"]["reason"]

    def resumed_after(position: int) -> list[SseItem]:
        out: list[SseItem] = []
        with httpx.Client(timeout=httpx.Timeout(30, read=60)) as client:
            for item in sse(client, mesh.url, session_id, headers={"Last-Event-ID": str(position)}):
                if item.data is None:
                    continue
                out.append(item)
                if item.event == "AgentResumed" and item.data["event"]["agent"] == agent:
                    break
        return out

    after_pair_start = resumed_after(at)
    assert int(after_pair_start[0].id or "") == at + 1
    assert after_pair_start[-1].event == "AgentResumed"
    assert after_pair_start[-1].data is not None
    assert after_pair_start[-1].data["event"]["epoch"] == resuming["event"]["epoch"]
    before_pair = resumed_after(at - 1)
    assert before_pair[0].event == "AgentResuming" and int(before_pair[0].id or "") == at
    assert before_pair[-1].event == "AgentResumed"
    ids = [int(i.id or "") for i in before_pair]
    assert ids == list(range(at, at + len(ids)))

    done = wait_status(mesh.url, session_id, timeout=90)
    assert done["status"] == "completed"
    resumed = next(a for a in done["agents"] if a["ref"] == agent)
    assert resumed["resumes"] == 1 and resumed["resuming"] is False
    wait_until(lambda: len(frames(mesh.url, session_id)) == done["last_index"] + 1, 10)
