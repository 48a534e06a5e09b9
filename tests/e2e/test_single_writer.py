"""Each session has one writer, on real processes (an ``apomesh serve`` daemon, worker processes, a
real nats-server): every change is decided against the folded state and checked by the pure fold
before it is appended, so a duplicate command is refused with 409 and nothing is written; and a
session whose log another writer appended to, or whose lease another owner took, is no longer
driven here.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import anyio
import anyio.to_thread
import httpx
import msgspec
import pytest
from tests.e2e.api_support import asker, start, view, wait_status, wait_until

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.kv import LEASES_BUCKET, KvBuckets, encode_key
from apomesh.adapters.nats_connect import connect
from apomesh.core import envelope
from apomesh.core.errors import AppendConflict
from apomesh.core.events import AgentSnapshotted, HitlAnswered, ModelRetrying
from apomesh.core.state import fold
from apomesh.runtime.presence import DaemonRecord
from apomesh.testing import Mesh

ANSWERS = 6


def answer_all_at_once(url: str, path: str, answers: list[str]) -> list[httpx.Response]:
    """POST every answer to ``path`` from its own thread, released together."""
    gate = threading.Barrier(len(answers))
    responses: list[httpx.Response | None] = [None] * len(answers)

    def one(i: int) -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            gate.wait()
            responses[i] = client.post(path, json={"answer": answers[i]})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(answers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r is not None for r in responses)
    return [r for r in responses if r is not None]


async def read_log(nats_url: str, session_id: str) -> list[envelope.Envelope]:
    nc = await connect([nats_url])
    try:
        return await JetStreamLog(nc).read(session_id)
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_concurrent_answers_to_one_pause_store_exactly_one(mesh: Mesh) -> None:
    session_id = start(mesh.url, "choose a cover", asker("Blue or red?"))
    paused = wait_status(mesh.url, session_id, ("paused",))
    (pause,) = paused["hitl_pending"]
    path = f"/v1/sessions/{session_id}/hitl/{pause['pause_id']}"
    answers = [f"answer {i}" for i in range(ANSWERS)]
    responses = await anyio.to_thread.run_sync(answer_all_at_once, mesh.url, path, answers)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [202] + [409] * (ANSWERS - 1), [r.text for r in responses]
    assert {r.json()["error"] for r in responses if r.status_code == 409} == {"command_refused"}
    accepted = answers[[r.status_code for r in responses].index(202)]

    done = wait_status(mesh.url, session_id)
    assert done["status"] == "completed", done
    envelopes = await read_log(mesh.nats_url, session_id)
    stored = [e.event for e in envelopes if isinstance(e.event, HitlAnswered)]
    assert [a.answer for a in stored] == [accepted]
    assert fold(envelopes, session_id).status == "completed"  # the log folds whole

    # A daemon started again on the same data finds the session whole, never undecodable.
    await anyio.to_thread.run_sync(mesh.daemon.kill)
    await anyio.to_thread.run_sync(mesh.daemon.start)
    assert view(mesh.url, session_id)["status"] == "completed"
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as client:
        recoverable = (await client.get("/v1/recoverable")).json()["sessions"]
        assert session_id not in {r["session_id"] for r in recoverable}
        verified = (await client.get(f"/v1/sessions/{session_id}/verify")).json()
    assert verified["ok"], verified


def slow_lister(turns: int, delay: float = 0.3) -> dict[str, Any]:
    """A root agent that lists the workspace ``turns`` times (under its step budget), ``delay``
    seconds each, then answers."""
    return {
        "name": "slow-lister",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": ["fs.list"],
        "model": {
            "provider": "scripted",
            "turns": [
                {"tool_calls": [{"tool": "fs.list", "args": {"path": "."}}], "delay": delay}
                for _ in range(turns)
            ]
            + [{"final": "listed"}],
        },
    }


async def append_behind_the_daemons_back(nats_url: str, session_id: str) -> int:
    """Append one event to the session's log as another writer would; answers its index."""
    nc = await connect([nats_url])
    try:
        log = JetStreamLog(nc)
        while True:
            index = await log.last_index(session_id) + 1
            # What a stale writer of this session (a daemon thawed after its lease moved) could
            # still have logged: its agent's model call being tried again.
            event = ModelRetrying("root", attempt=1, delay=0.1, reason="a stale writer's turn")
            env = envelope.make(session_id, index, time.time(), uuid.uuid4().hex, event)
            try:
                await log.append(session_id, [env])
                return index
            except AppendConflict:
                continue  # the daemon appended meanwhile: go after its event
    finally:
        await nc.close()


async def lease_owner(nats_url: str, session_id: str) -> str | None:
    nc = await connect([nats_url])
    try:
        kv = await KvBuckets.open(nc)
        return await kv.leases.owner(session_id)
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_an_append_conflict_under_this_daemons_lease_folds_the_log_again_and_drives_on(
    mesh: Mesh,
) -> None:
    """Another writer appends behind the daemon's back while the daemon holds the session's lease
    (a stale writer: a daemon thawed after its lease moved here, whose append landed first). The
    daemon's next append meets that event and is refused; its lease still its own, it folds the
    log as it now stands and drives the session on to its end with the other writer's event in
    its log, and it says so and counts the conflict. Nothing else is lost or written twice."""
    session_id = start(mesh.url, "list slowly", slow_lister(12))
    with anyio.fail_after(60):
        while not any(
            isinstance(e.event, AgentSnapshotted) for e in await read_log(mesh.nats_url, session_id)
        ):
            await anyio.sleep(0.1)
    assert await lease_owner(mesh.nats_url, session_id) is not None
    foreign = await append_behind_the_daemons_back(mesh.nats_url, session_id)
    ended = wait_status(mesh.url, session_id, timeout=60)
    assert ended["status"] == "completed", ended
    said = mesh.daemon.output_tail(200_000)
    assert "another writer appended to its log" in said
    assert "a stale writer appended to its log while this daemon held its lease" in said
    log = await read_log(mesh.nats_url, session_id)
    assert any(e.index == foreign for e in log)
    assert fold(log).status == "completed"
    assert view(mesh.url, session_id)["last_index"] == log[-1].index
    metrics = httpx.get(f"{mesh.url}/metrics", timeout=30).text
    assert "apomesh_append_conflicts_total 1" in metrics
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as client:
        verified = (await client.get(f"/v1/sessions/{session_id}/verify")).json()
    assert verified["ok"], verified


async def take_the_lease(nats_url: str, session_id: str, owner: str) -> str:
    """Move the session's lease to ``owner`` as a peer's takeover does (by compare-and-set on its
    revision), with a presence record for ``owner``; answers the old owner."""
    nc = await connect([nats_url])
    try:
        js = nc.jetstream()
        kv = await KvBuckets.open(nc)
        record = DaemonRecord(id=owner, host="elsewhere", url="", incarnation=owner)
        await kv.daemons.put(owner, msgspec.msgpack.encode(record))  # alive, driving nothing
        bucket = await js.key_value(LEASES_BUCKET)
        entry = await bucket.get(encode_key(session_id))
        assert entry.value and entry.revision
        await bucket.update(encode_key(session_id), owner.encode(), last=entry.revision)
        return entry.value.decode()
    finally:
        await nc.close()


async def give_the_lease_back(nats_url: str, session_id: str, owner: str) -> None:
    """Delete the session's lease as ``owner`` releases it (at the revision it holds)."""
    nc = await connect([nats_url])
    try:
        bucket = await nc.jetstream().key_value(LEASES_BUCKET)
        entry = await bucket.get(encode_key(session_id))
        assert entry.value == owner.encode()
        await bucket.delete(encode_key(session_id), last=entry.revision)
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_a_lease_held_by_another_owner_stops_this_daemon_driving_the_session(
    mesh: Mesh,
) -> None:
    """The daemon stops driving a session whose lease another owner took, and never takes it
    back while that owner is alive. When that owner gives the lease back without driving the
    session (two thawed writers that each stopped on the other's append), the daemon, which was
    watching it, drives it again to its end: a session is never left with no writer."""
    session_id = start(mesh.url, "list slowly", slow_lister(30, delay=0.5))
    with anyio.fail_after(60):
        while not any(
            isinstance(e.event, AgentSnapshotted) for e in await read_log(mesh.nats_url, session_id)
        ):
            await anyio.sleep(0.1)
    daemon_owner = await take_the_lease(mesh.nats_url, session_id, "another-daemon")
    assert daemon_owner not in (None, "another-daemon")

    def driven() -> int:
        sessions: int = httpx.get(f"{mesh.url}/healthz", timeout=30).json()["sessions"]
        return sessions

    # The daemon sees its lease taken (it follows the lease bucket): it stops driving the session
    # (and never takes the lease back from its owner).
    wait_until(lambda: driven() == 0, timeout=30, what="the session no longer driven")
    assert "held by another-daemon" in mesh.daemon.output_tail(200_000)
    assert await lease_owner(mesh.nats_url, session_id) == "another-daemon"
    settled = await read_log(mesh.nats_url, session_id)
    await anyio.sleep(2.0)
    assert len(await read_log(mesh.nats_url, session_id)) == len(settled)

    await give_the_lease_back(mesh.nats_url, session_id, "another-daemon")
    ended = wait_status(mesh.url, session_id, timeout=90)
    assert ended["status"] == "completed", ended
    assert "no daemon drove it" in mesh.daemon.output_tail(200_000)
    log = await read_log(mesh.nats_url, session_id)
    assert fold(log).status == "completed"
