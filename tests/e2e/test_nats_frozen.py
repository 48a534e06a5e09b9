"""A nats-server frozen (SIGSTOP) mid-run, under sessions answered by the fresh-model server on
real daemon and worker processes: the single server, then let go (SIGCONT); and the node of a
3-node cluster the daemon is connected to, kept frozen while the sessions finish on the others.

A frozen server is not a stopped one: no connection drops, every request, append, lease write and
heartbeat simply gets no answer until the server runs again (a disk stall, a paused VM, a long
garbage collection). Here it stays frozen longer than an append's retry budget and a worker's
loss threshold, while solo, fanout and refine sessions make side-effecting calls. Afterwards every
session must end `completed` with no operator acting, every effect the model asked for must have
run exactly once, and no acknowledged event may be lost (``tests/e2e/chaos_audit.py``); and no
worker may be declared lost for the silence the daemon could not hear (its echo,
``WorkerPool.liveness_forever``).

On the cluster the daemon and the workers must leave the frozen node for the others once their
pings go unanswered (``[nats] ping_interval``, ``max_pings_outstanding``), and the sessions must
complete exactly once while it is still frozen.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from tests.e2e.chaos_kit import ClusterMesh, FreshChaos, use_fresh_model
from tests.fakes.fresh_model import FreshModelServer

from apomesh.sdk.client import Client, ServerUnavailable
from apomesh.testing import Mesh

FROZEN_SECONDS = 7.0
"""Longer than an append's retry budget (5 s) and the mesh's worker loss threshold (0.9 s)."""


@pytest.mark.anyio
async def test_sessions_complete_exactly_once_across_a_frozen_nats_server(
    bare_mesh: Mesh,
) -> None:
    mesh = bare_mesh
    with FreshModelServer() as server:
        mesh.start(2, config=use_fresh_model(mesh, server.base_url))
        async with Client(mesh.url, reconnect_window=120) as client:
            chaos = FreshChaos(mesh, client, server.model, server.log, rng=random.Random(21))
            shapes = ["solo", "fanout", "refine", "solo", "fanout", "refine"]
            ids = await _under_way(client, chaos, "frozen", shapes)
            pid = mesh.server.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                await anyio.sleep(FROZEN_SECONDS)
            finally:
                os.kill(pid, signal.SIGCONT)
            audits = []
            operator_needed: set[str] = set()
            for session_id, shape in zip(ids, shapes, strict=True):
                in_time = await _ends_by_itself(client, session_id, operator_needed)
                audits.append(await chaos.audit(session_id, shape, in_time=in_time))
    problems = [(a.session_id, a.status, a.problems) for a in audits if not a.ok]
    assert not problems, problems
    assert all(a.status == "completed" for a in audits), [a.status for a in audits]
    assert chaos.tally.duplicates == 0
    assert not operator_needed, "a frozen server put sessions on the recoverable list"
    output = mesh.daemon.output_tail(400_000)
    assert "Traceback" not in output, _around_traceback(output)
    # The daemon heard nothing while the server was frozen, its own echo included: nobody was
    # judged on that silence, so no agent was dispatched twice for it.
    assert " lost: " not in output, output[-4000:]
    assert "delivers to this daemon again" in output


@pytest.fixture
def cluster_mesh(nats_cluster: Any, tmp_path: Path) -> Iterator[ClusterMesh]:
    """The system on the 3-node cluster, pinging its servers every second (stale after about
    three seconds unanswered), not started yet."""
    mesh = ClusterMesh(list(nats_cluster), tmp_path)
    pings = {"APOMESH_NATS_PING_INTERVAL": "1", "APOMESH_NATS_MAX_PINGS_OUTSTANDING": "2"}
    mesh.env.update(pings)
    mesh.daemon.env.update(pings)
    try:
        yield mesh
    finally:
        mesh.close()


@pytest.mark.anyio
async def test_sessions_finish_on_the_other_nodes_while_the_daemons_node_is_frozen(
    cluster_mesh: ClusterMesh,
) -> None:
    mesh = cluster_mesh
    with FreshModelServer() as server:
        config = use_fresh_model(mesh, server.base_url)
        await anyio.to_thread.run_sync(lambda: mesh.start(2, config=config))
        async with Client(mesh.url, reconnect_window=120) as client:
            chaos = FreshChaos(mesh, client, server.model, server.log, rng=random.Random(22))
            shapes = ["solo", "fanout", "refine", "solo"]
            ids = await _under_way(client, chaos, "cluster frozen", shapes)
            on = await _daemons_server(mesh.url)
            frozen = next(s for s in mesh.servers if s.url.endswith(f":{on.split(':')[-1]}"))
            assert frozen.pid is not None
            os.kill(frozen.pid, signal.SIGSTOP)
            try:
                operator_needed: set[str] = set()
                ended = [await _ends_by_itself(client, sid, operator_needed) for sid in ids]
                moved_to = await _daemons_server(mesh.url)
                audits = [
                    await chaos.audit(sid, shape, in_time=in_time)
                    for sid, shape, in_time in zip(ids, shapes, ended, strict=True)
                ]
            finally:
                os.kill(frozen.pid, signal.SIGCONT)
    problems = [(a.session_id, a.status, a.problems) for a in audits if not a.ok]
    assert not problems, problems
    assert all(a.status == "completed" for a in audits), [a.status for a in audits]
    assert chaos.tally.duplicates == 0
    assert not operator_needed, "a frozen node put sessions on the recoverable list"
    assert moved_to != on, "the daemon stayed on the frozen node"
    output = mesh.daemon.output_tail(400_000)
    assert "Traceback" not in output, _around_traceback(output)


def _around_traceback(output: str) -> str:
    """The daemon's output from a little before its first traceback on."""
    at = output.find("Traceback")
    return output[max(0, at - 1500) : at + 4000]


async def _under_way(client: Client, chaos: FreshChaos, tag: str, shapes: list[str]) -> list[str]:
    """Start a session of each shape; answer their ids once the first has logged a
    side-effecting call's intent (the sessions are under way)."""
    ids = [
        await client.start_session(f"{tag} {n} {shape}", definition=chaos.definition(shape))
        for n, shape in enumerate(shapes)
    ]
    with anyio.fail_after(60):
        async for record in client.events(ids[0]):
            if record.kind == "ToolCallIntent":
                break
    return ids


async def _daemons_server(url: str) -> str:
    """The ``host:port`` of the server the daemon is connected to, once it is connected."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        with anyio.fail_after(60):
            while True:
                health = (await http.get("/healthz")).json()
                if health.get("nats_server"):
                    return str(health["nats_server"])
                await anyio.sleep(0.2)


async def _ends_by_itself(client: Client, session_id: str, operator_needed: set[str]) -> bool:
    """Wait until the session is terminal, noting it (and resuming it, so the audit still runs)
    if it lands on the recoverable list; False when 120 s pass first. A 503 (the daemon's NATS
    connection moving to another server) is asked again, as a client would."""
    with anyio.move_on_after(120):
        while True:
            try:
                view = await client.get_session(session_id)
                if view.status in ("completed", "failed", "cancelled"):
                    return True
                if session_id in {r.session_id for r in await client.list_recoverable()}:
                    operator_needed.add(session_id)
                    await client.resume(session_id)
            except ServerUnavailable:
                pass
            await anyio.sleep(0.5)
    return False
