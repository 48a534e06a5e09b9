"""A session survives the loss of its daemon's host: on the 3-node cluster, with the replicated
state store on (``[store] replicated = "auto"`` turns it on for a daemon given NATS URLs), a
daemon runs a session answered by the fresh-model server (a model asked twice answers
differently) partly, is SIGKILLed and its data dir deleted; a new daemon with a fresh, empty data
dir on the same cluster resumes the session from the replicated snapshots and recorded turns and
completes it, each side effect exactly once, and its own verification finds every snapshot the
log points to."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from tests.e2e.chaos_kit import ClusterMesh, FreshChaos, fresh_solo, use_fresh_model
from tests.fakes.fresh_model import FreshModelServer

from apomesh.sdk.client import Client

LEASE_TTL = 3.0


@pytest.fixture
def cluster_mesh(nats_cluster: Any, tmp_path: Path) -> Iterator[ClusterMesh]:
    """The system on the cluster, not started yet: the test configures it first."""
    mesh = ClusterMesh(list(nats_cluster), tmp_path)
    # The workspace (the world the side effects land in) outlives the daemon's host.
    mesh.daemon.workspace = tmp_path / "workspace"
    # A short lease, so the new daemon takes the session over within seconds (default 30 s).
    mesh.daemon.env["APOMESH_DAEMON_LEASE_TTL"] = str(LEASE_TTL)
    try:
        yield mesh
    finally:
        mesh.close()


@pytest.mark.anyio
async def test_a_fresh_daemon_resumes_a_session_from_the_replicated_store(
    cluster_mesh: ClusterMesh, tmp_path: Path
) -> None:
    mesh = cluster_mesh
    with FreshModelServer() as server:
        config = use_fresh_model(mesh, server.base_url)
        await anyio.to_thread.run_sync(lambda: mesh.start(2, config=config))
        async with Client(mesh.url) as client:
            chaos = FreshChaos(mesh, client, server.model, server.log, rng=random.Random(12))
            session_id = await client.start_session(
                "host loss solo", definition=fresh_solo(server.model, appends=6)
            )
            recorded = 0
            with anyio.fail_after(60):
                async for record in client.events(session_id):
                    assert record.kind != "SessionEnded", "the session ended before the kill"
                    recorded += record.kind == "ToolCallRecorded"
                    if recorded == 2:
                        break
            # The host is lost: the daemon is SIGKILLed and its data dir (LMDB) goes with it.
            old_dir = mesh.daemon.data_dir
            await anyio.to_thread.run_sync(mesh.daemon.kill)
            shutil.rmtree(old_dir)
            mesh.daemon.data_dir = tmp_path / "daemon-b"
            mesh.daemon.data_dir.mkdir(mode=0o700)
            mesh.daemon.log_file = mesh.daemon.data_dir / "serve.log"
            await anyio.to_thread.run_sync(mesh.daemon.start)
            await anyio.to_thread.run_sync(mesh.wait_workers, 2)

            in_time = await chaos.settle(session_id)
            audit = await chaos.audit(session_id, "solo", in_time=in_time)
            verification = await client.verify_session(session_id)
            records = await chaos.read_log(session_id)
    assert audit.ok, audit.problems
    assert audit.status == "completed" and audit.duplicates == 0 and audit.never_run == 0
    assert audit.output_from_model is True
    assert verification["problems"] == [], verification
    resumed = [r for r in records if r.kind == "AgentResuming"]
    assert resumed and resumed[0].event["snapshot_id"], "the agent did not resume from a snapshot"
