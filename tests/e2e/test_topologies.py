"""Sessions on the NATS shapes production uses: a three-node cluster with three-replica streams,
and a worker behind a leaf node that speaks core NATS only. Real nats-server processes, a real
``apomesh serve`` process and real ``apomesh worker`` processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from apomesh.adapters.heartbeats import HEARTBEAT_STREAM
from apomesh.adapters.jetstream_log import LOG_STREAM
from apomesh.adapters.natsserver import NatsCluster, NatsServer
from apomesh.runtime.composition import load_definition_file
from apomesh.testing import DaemonProcess, WorkerProcess

DEFINITIONS = Path(__file__).parent / "definitions"
TIMEOUT = 60.0


def run_session(url: str, goal: str, definition: str) -> dict[str, Any]:
    agent = load_definition_file(DEFINITIONS / f"{definition}.toml")
    response = httpx.post(f"{url}/v1/sessions", json={"goal": goal, "definition": agent})
    assert response.status_code == 201, response.text
    session_id = response.json()["session_id"]
    deadline = time.monotonic() + TIMEOUT
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        view = httpx.get(f"{url}/v1/sessions/{session_id}").json()
        if view["status"] in ("completed", "failed", "cancelled"):
            return view
        time.sleep(0.05)
    raise AssertionError(f"session {session_id} did not end: {view}")


def wait_worker(url: str, name: str) -> str:
    """The id of the worker called ``name`` once the daemon lists it."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        for worker in httpx.get(f"{url}/v1/workers").json()["workers"]:
            if worker["name"] == name and worker.get("alive", True):
                return str(worker["id"])
        time.sleep(0.05)
    raise AssertionError(f"worker {name} never registered")


def holds_connection(server: NatsServer, prefix: str) -> bool:
    connz: dict[str, Any] = server.monitor("connz") or {}
    connections: list[dict[str, Any]] = connz.get("connections") or []
    return any(str(c.get("name", "")).startswith(prefix) for c in connections)


def stream_replicas(urls: list[str], stream: str) -> int:
    async def ask() -> int:
        nc = await nats.connect(urls)
        try:
            info = await nc.jetstream().stream_info(stream)
            return int(info.config.num_replicas or 1)
        finally:
            await nc.close()

    return asyncio.run(ask())


@pytest.fixture
def daemon_dir(tmp_path: Path) -> Path:
    return tmp_path / "daemon"


@pytest.fixture
def stopper() -> Iterator[list[Any]]:
    """Processes to stop at teardown, workers first."""
    started: list[Any] = []
    yield started
    for process in reversed(started):
        process.stop()


def test_cluster_of_three_with_replicated_streams(
    nats_cluster: NatsCluster, daemon_dir: Path, stopper: list[Any]
) -> None:
    daemon = DaemonProcess(nats_cluster.urls, daemon_dir, extra_args=("--replicas", "3"))
    daemon.start()
    stopper.append(daemon)
    # The worker goes to a node the daemon is not connected to, so every request between them
    # crosses the cluster's routes.
    daemon_node = next(s for s in nats_cluster if holds_connection(s, "apomesh-daemon"))
    other = next(s for s in nats_cluster if s is not daemon_node)
    worker = WorkerProcess([other.url], daemon.workspace, "routed")
    worker.start()
    stopper.append(worker)
    worker_id = wait_worker(daemon.url, "routed")

    view = run_session(daemon.url, "across the cluster", "fanout")

    assert view["status"] == "completed", view
    assert {a["worker"] for a in view["agents"]} == {worker_id}
    assert (daemon.workspace / view["session_id"] / "done-2.txt").read_text() == "gamma done"
    assert holds_connection(other, "apomesh-worker-routed")
    assert not holds_connection(other, "apomesh-daemon")
    assert stream_replicas(nats_cluster.urls, LOG_STREAM) == 3
    assert stream_replicas(nats_cluster.urls, HEARTBEAT_STREAM) == 3


def test_worker_behind_a_leaf_node(
    nats_hub_leaf: tuple[NatsServer, NatsServer], daemon_dir: Path, stopper: list[Any]
) -> None:
    hub, leaf = nats_hub_leaf
    daemon = DaemonProcess([hub.url], daemon_dir)
    daemon.start()
    stopper.append(daemon)
    worker = WorkerProcess([leaf.url], daemon.workspace, "edge")
    worker.start()
    stopper.append(worker)
    worker_id = wait_worker(daemon.url, "edge")
    # The worker's only connection is to the leaf, which runs no JetStream.
    assert holds_connection(leaf, "apomesh-worker-edge")
    assert not holds_connection(hub, "apomesh-worker-edge")
    varz: dict[str, Any] = leaf.monitor("varz") or {}
    assert varz.get("jetstream", {}).get("config") is None

    view = run_session(daemon.url, "from the edge", "solo")

    assert view["status"] == "completed", view
    assert view["output"] == "wrote from the edge"
    (root,) = view["agents"]
    assert root["worker"] == worker_id
    assert (daemon.workspace / view["session_id"] / "solo.txt").read_text() == "from the edge"
    # No control-plane identity configured: the daemon's one connection does the control work,
    # and its log says so.
    assert "no control-plane identity in [nats]" in daemon.log_file.read_text()
