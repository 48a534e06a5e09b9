"""An agent whose working memory outgrows the NATS ``max_payload``, on real processes: a
nats-server with a 2 MiB payload limit, an ``apomesh serve`` daemon and two ``apomesh worker``
processes. The agent reads three files of 900 kB each (every node report fits, the conversation
does not), then thinks for a while; the worker running it is SIGKILLed meanwhile, and the agent is
re-dispatched to the other worker, which fetches the memory page by page and completes the
session. The log shows one resume, not a loop of failed dispatches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from tests.e2e.test_runtime import kinds, log_of, start, view, wait_ended

from apomesh.sdk.client import SyncClient
from apomesh.testing import Mesh

MIB = 1024 * 1024
FILE_BYTES = 900_000
FILES = 3


@pytest.fixture
def small_payload_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    from apomesh.adapters.natsserver import NatsServer, single_node

    base = tmp_path_factory.mktemp("mesh")
    server = NatsServer(
        msgspec.structs.replace(single_node(base, name="nats"), max_payload=2 * MIB)
    )
    server.start()
    system = Mesh(server, base)
    try:
        system.daemon.start()
        system.worker()
        system.worker()
        system.wait_workers(2)
        yield system
    finally:
        system.close()
        server.stop()


def reader() -> dict[str, Any]:
    turns: list[dict[str, Any]] = [
        {"tool_calls": [{"tool": "fs.read", "args": {"path": f"big{i}.txt"}}]} for i in range(FILES)
    ]
    turns.append({"delay": 4, "final": "read it all"})
    return {
        "name": "big-reader",
        "version": "1.0.0",
        "coordination": "solo",
        "workspace": "shared",  # it reads files the test put there
        "tools": ["fs.read"],
        "model": {"provider": "scripted", "turns": turns},
    }


def test_an_agent_whose_memory_is_over_max_payload_is_redispatched_and_completes(
    small_payload_mesh: Mesh,
) -> None:
    mesh = small_payload_mesh
    mesh.daemon.workspace.mkdir(parents=True, exist_ok=True)
    for i in range(FILES):  # distinct contents, so the loop guard never resets the conversation
        (mesh.daemon.workspace / f"big{i}.txt").write_text(str(i) * FILE_BYTES)
    session_id = start(mesh.url, "read the big files", reader())
    with SyncClient(mesh.url) as client:
        for record in client.events(session_id):
            if record.kind == "AgentSnapshotted" and record.event["step"] >= FILES:
                break
    # Its memory is now over 2 MiB: kill the worker running it, mid-thought.
    (root,) = view(mesh.url, session_id)["agents"]
    victim = next(w for w in mesh.workers if root["worker"].startswith(f"{w.name}-"))
    victim.kill()
    ended = wait_ended(mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "read it all"
    records = log_of(mesh.url, session_id)
    names = kinds(records)
    assert names.count("AgentResuming") == 1, names
    assert names.count("AgentResumed") == 1, names
    dispatched = [
        r for r in records if r.kind == "AgentLifecycle" and r.event["phase"] == "dispatched"
    ]
    assert len(dispatched) == 2, names
    assert dispatched[-1].event["worker"] != root["worker"]
