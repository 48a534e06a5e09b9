"""The embedded nats-server of ``apomesh serve`` and the data dir, on real processes: only the
daemon and the workers it issued credentials to can connect, each within its role; the state on
disk is private to the daemon's user, and a data dir someone else prepared is refused."""

from __future__ import annotations

import asyncio
import os
import re
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from tests.e2e.api_support import wait_until

from apomesh.testing import DaemonProcess, WorkerProcess

TIMEOUT = 60.0
NOBODY = 65534


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def nats_url(daemon: DaemonProcess) -> str:
    """The embedded server's URL, from the line ``apomesh serve`` prints when it is up (its API
    may answer a moment before that line reaches the log file)."""
    match = wait_until(
        lambda: re.search(r"NATS\s+(nats://127\.0\.0\.1:\d+)", daemon.output_tail()),
        timeout=TIMEOUT,
        what="the serve line naming the embedded NATS URL",
    )
    return str(match[1])


def worker_file(daemon: DaemonProcess, n: int = 1) -> dict[str, Any]:
    path = daemon.data_dir / "credentials" / f"worker-{n}.toml"
    return tomllib.loads(path.read_text())["nats"]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A daemon on its embedded nats-server with one local worker, shared by the module's tests
    (which only connect to it and probe what it refuses)."""
    daemon = DaemonProcess([], tmp_path_factory.mktemp("embedded") / "daemon", workers=1)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


async def connect_and_collect(url: str, **options: Any) -> tuple[Any, list[str]]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        url, allow_reconnect=False, max_reconnect_attempts=0, error_cb=on_error, **options
    )
    return nc, errors


def test_an_unauthenticated_client_is_refused(embedded: DaemonProcess) -> None:
    url = nats_url(embedded)

    async def attempt(**options: Any) -> None:
        await connect_and_collect(url, connect_timeout=3, **options)

    with pytest.raises(Exception, match=r"(?i)authorization"):
        asyncio.run(attempt())
    with pytest.raises(Exception, match=r"(?i)authorization"):
        asyncio.run(attempt(user="worker-1", password="guessed"))
    with pytest.raises(Exception, match=r"(?i)authorization"):
        asyncio.run(attempt(user="apomesh-daemon", password="guessed"))


def test_a_worker_credential_cannot_read_or_write_the_log_or_dispatch(
    embedded: DaemonProcess,
) -> None:
    creds = worker_file(embedded)

    async def probe() -> list[str]:
        nc, errors = await connect_and_collect(
            creds["urls"][0],
            user=creds["user"],
            password=creds["password"],
            inbox_prefix=f"_INBOX.worker.{creds['user']}",
        )
        try:
            await nc.subscribe("apomesh.log.>")
            await nc.publish("apomesh.log.forged", b"garbage")
            await nc.publish("apomesh.dispatch.local-1-0", b"forged run")
            await nc.subscribe("apomesh.dispatch.>")
            with pytest.raises(Exception):  # noqa: B017 - no responder or a permission error
                await nc.request("$JS.API.STREAM.INFO.APOMESH_LOG", b"", timeout=2)
            await nc.flush()
            await asyncio.sleep(0.5)
        finally:
            await nc.close()
        return errors

    errors = asyncio.run(probe())
    violations = [e for e in errors if "permissions violation" in e.lower()]
    assert any("apomesh.log.>" in e for e in violations), errors
    assert any("apomesh.log.forged" in e for e in violations), errors
    assert any("apomesh.dispatch.local-1-0" in e for e in violations), errors
    assert any("apomesh.dispatch.>" in e for e in violations), errors


def test_the_control_plane_user_cannot_reach_jetstream_or_the_log(
    embedded: DaemonProcess,
) -> None:
    """The daemon answers workers and dispatches on a connection of its own per-start control
    user (the server lists it), and the server refuses that user a purge of the log and a write
    onto a session's log."""
    url = nats_url(embedded)
    (server_config,) = embedded.data_dir.rglob("nats-server.conf")
    text = server_config.read_text()
    found = re.search(r'user: "apomesh-control"\s+password: "([^"]+)"', text)
    assert found is not None, "no control user in the embedded server's config"
    monitor = re.search(r'http: "([^"]+)"', text)
    assert monitor is not None
    connz = httpx.get(f"http://{monitor[1]}/connz?auth=true", timeout=10).json()
    named = {(c.get("name", ""), c.get("authorized_user")) for c in connz["connections"]}
    assert any(
        name.startswith("apomesh-control-") and user == "apomesh-control" for name, user in named
    ), named

    async def probe() -> list[str]:
        nc, errors = await connect_and_collect(
            url, user="apomesh-control", password=found[1], inbox_prefix="_INBOX.control"
        )
        try:
            await nc.publish("$JS.API.STREAM.PURGE.APOMESH_LOG", b"{}")
            await nc.publish("apomesh.log.forged", b"garbage")
            await nc.flush()
            await asyncio.sleep(0.5)
        finally:
            await nc.close()
        return errors

    errors = asyncio.run(probe())
    violations = [e.lower() for e in errors if "permissions violation" in e.lower()]
    assert any("$js.api.stream.purge.apomesh_log" in e for e in violations), errors
    assert any("apomesh.log.forged" in e for e in violations), errors


def test_a_worker_process_joins_with_the_credential_file(tmp_path: Path) -> None:
    daemon = DaemonProcess([], tmp_path / "daemon", workers=0)
    daemon.start()
    config = daemon.data_dir / "credentials" / "worker-1.toml"
    worker = WorkerProcess([], daemon.workspace, "joined", config=config)
    worker.start()
    try:
        definition = {
            "name": "joined",
            "coordination": "solo",
            "model": {"provider": "scripted", "turns": [{"final": "done by a joined worker"}]},
        }
        response = httpx.post(
            f"{daemon.url}/v1/sessions", json={"goal": "go", "definition": definition}
        )
        assert response.status_code == 201, response.text
        session_id = response.json()["session_id"]
        deadline = time.monotonic() + TIMEOUT
        view: dict[str, Any] = {}
        while time.monotonic() < deadline:
            view = httpx.get(f"{daemon.url}/v1/sessions/{session_id}").json()
            if view["status"] != "running":
                break
            time.sleep(0.1)
        assert view["status"] == "completed", (view, worker.log_file.read_text())
        assert view["agents"][0]["worker"] == "worker-1"
    finally:
        worker.stop()
        daemon.stop()


def test_the_state_on_disk_is_private(embedded: DaemonProcess) -> None:
    data = embedded.data_dir
    assert mode(data) == 0o700
    for directory in (data / "nats", data / "lmdb", data / "credentials"):
        assert mode(directory) == 0o700, directory
    for file in (
        data / "nats" / "nats-server.conf",
        data / "nats" / "nats-server.log",
        data / "lmdb" / "data.mdb",
        data / "lmdb" / "lock.mdb",
        data / "daemon.id",
        data / "credentials" / "worker-1.toml",
    ):
        assert mode(file) == 0o600, file


def serve(data: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "apomesh", "serve", "--data", str(data), "--http", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_data_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "planted"
    data.mkdir(mode=0o700)
    (data / "tokens.json").write_text('{"tokens": []}')
    os.chown(data, NOBODY, NOBODY)
    result = serve(data)
    assert result.returncode == 1, result
    assert "unsafe_data_dir" in result.stderr and str(NOBODY) in result.stderr, result.stderr
    assert not (data / "lmdb").exists()


def test_a_world_writable_data_dir_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "open"
    data.mkdir()
    os.chmod(data, 0o777)
    result = serve(data)
    assert result.returncode == 1, result
    assert "unsafe_data_dir" in result.stderr, result.stderr
    assert not (data / "lmdb").exists()


def test_a_planted_symlink_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    data = tmp_path / "daemon"
    data.mkdir(mode=0o700)
    (data / "daemon.id").symlink_to(victim)
    (data / "nats").mkdir(mode=0o700)
    (data / "nats" / "nats-server.conf").symlink_to(victim)
    daemon = DaemonProcess([], data, workers=0)
    daemon.start()
    daemon.stop()
    assert victim.read_text() == "precious\n"
    assert not (data / "daemon.id").is_symlink()
    assert not (data / "nats" / "nats-server.conf").is_symlink()
