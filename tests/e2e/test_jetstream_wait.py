"""A daemon started while its cluster has no JetStream leader waits for one: ``apomesh serve``
connected to a peer of a 3-node cluster whose two other peers (the meta leader among them) are
frozen (SIGSTOP) finds the server up but JetStream unanswering. It logs one warning, tries again
every second (``[nats] jetstream_ready_timeout``), and once the peers run again it starts and runs
a session; given too short a wait it stops with ``log_unavailable``, naming what did not answer.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest
from tests.e2e.chaos_kit import appender

from apomesh.adapters.natsserver import NatsCluster, NatsServer
from apomesh.sdk.client import Client
from apomesh.testing import DaemonProcess

pytestmark = pytest.mark.anyio

WARNING = "JetStream does not answer yet"


def leader_and_followers(cluster: NatsCluster) -> tuple[NatsServer, list[NatsServer]]:
    """The meta leader and the other peers, as the peers' ``jsz`` names them."""
    names = {server.spec.name: server for server in cluster}
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        for server in cluster:
            jsz = server.monitor("jsz") or {}
            meta = jsz.get("meta_cluster")
            leader = meta.get("leader") if isinstance(meta, dict) else None
            if leader in names:
                return names[leader], [s for s in cluster if s is not names[leader]]
        time.sleep(0.1)
    raise AssertionError("no peer names a meta leader")


@contextmanager
def frozen(servers: list[NatsServer]) -> Iterator[None]:
    pids = [s.pid for s in servers if s.pid is not None]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def wait_logged(daemon: DaemonProcess, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in daemon.output_tail(20_000):
        assert daemon.proc.poll() is None, daemon.output_tail()
        assert time.monotonic() < deadline, daemon.output_tail()
        time.sleep(0.1)


async def test_a_daemon_started_without_a_jetstream_leader_starts_once_there_is_one(
    nats_cluster: NatsCluster, tmp_path: Path
) -> None:
    leader, (alone, other) = leader_and_followers(nats_cluster)
    daemon = DaemonProcess(
        [alone.url], tmp_path / "daemon", workers=1, extra_args=("--replicas", "3")
    )
    try:
        with frozen([leader, other]):
            daemon.launch()
            wait_logged(daemon, WARNING)
        daemon.wait_ready(timeout=60.0)
        assert daemon.output_tail(20_000).count(WARNING) == 1
        async with Client(daemon.url) as client:
            session_id = await client.start_session(
                "after-the-election", definition=appender(steps=1, delay=0.0)
            )
            with anyio.fail_after(60.0):
                while (await client.get_session(session_id)).status != "completed":
                    await anyio.sleep(0.05)
    finally:
        daemon.stop()


async def test_a_daemon_that_waits_past_its_limit_stops_with_log_unavailable(
    nats_cluster: NatsCluster, tmp_path: Path
) -> None:
    leader, (alone, other) = leader_and_followers(nats_cluster)
    daemon = DaemonProcess(
        [alone.url],
        tmp_path / "daemon",
        extra_args=("--replicas", "3"),
        env={"APOMESH_NATS_JETSTREAM_READY_TIMEOUT": "2"},
    )
    try:
        with frozen([leader, other]):
            daemon.launch()
            assert daemon.proc.wait(timeout=60.0) == 1
        # One attempt (its requests time out after 5 s) already outlasted the 2 s allowed.
        assert "error (log_unavailable): open bucket" in daemon.output_tail()
    finally:
        daemon.stop()
