"""One data dir, one daemon, on real ``apomesh serve`` processes with their embedded nats-server:
a second ``serve`` on a data dir in use stops at once naming the holder's pid and leaves the
first one serving; a SIGKILLed daemon's data dir serves again at once; the embedded server keeps
the port of its first start, so a worker process reconnects by itself after the daemon restarts,
and a port someone else took meanwhile is refused by its number."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.api_support import start, wait_status, wait_until

from apomesh.testing import DaemonProcess, WorkerProcess

TIMEOUT = 60.0


def scripted(final: str) -> dict[str, Any]:
    return {
        "name": "one-turn",
        "coordination": "solo",
        "model": {"provider": "scripted", "turns": [{"final": final}]},
    }


def flat(text: str) -> str:
    """Terminal output with its line wrapping undone."""
    return " ".join(text.split())


def serve_again(data: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Another ``apomesh serve`` on ``data``; it must end by itself (a daemon that would serve
    instead is killed and its output answered with its exit code, -9)."""
    process = subprocess.Popen(
        [
            sys.executable,
            *("-m", "apomesh", "serve", "--data", str(data), "--http", "127.0.0.1:0"),
            *("--workers", "0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "APOMESH_HTTP_AUTH": "off", **(env or {})},
    )
    try:
        out, errors = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        out, errors = process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, out, errors)


def embedded_nats_pid(daemon: DaemonProcess) -> int:
    return int((daemon.data_dir / "nats" / "nats-server.pid").read_text().strip())


def written_at_start(daemon: DaemonProcess) -> dict[str, tuple[int, bytes]]:
    """The files a start of ``serve`` writes in the data dir (not LMDB's or the server's store,
    which the running daemon writes to): each one's modification time and bytes."""
    data = daemon.data_dir
    names = ["daemon.lock", "daemon.id", "nats.port", "nats/nats-server.conf"]
    names += [str(path.relative_to(data)) for path in (data / "credentials").iterdir()]
    return {
        name: ((data / name).stat().st_mtime_ns, (data / name).read_bytes())
        for name in names
        if (data / name).exists()
    }


def embedded_url(daemon: DaemonProcess) -> str:
    """The embedded server's URL as the credential file for worker processes gives it."""
    text = (daemon.data_dir / "credentials" / "worker-1.toml").read_text()
    match = re.search(r'urls = \["(nats://127\.0\.0\.1:\d+)"\]', text)
    assert match is not None, text
    return match[1]


def healthy(daemon: DaemonProcess) -> dict[str, Any]:
    response = httpx.get(f"{daemon.url}/healthz", timeout=10)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert body["nats"] == "connected", body
    return body


def run_to_completion(daemon: DaemonProcess, final: str) -> dict[str, Any]:
    session_id = start(daemon.url, "go", scripted(final))
    view = wait_status(daemon.url, session_id, timeout=TIMEOUT)
    assert view["status"] == "completed", (view, daemon.output_tail())
    assert view["output"] == final, view
    return view


def wait_registered(daemon: DaemonProcess, worker_id: str) -> None:
    def listed() -> bool:
        rows = httpx.get(f"{daemon.url}/v1/workers", timeout=10).json()
        rows = rows["workers"] if isinstance(rows, dict) else rows
        return any(row.get("id") == worker_id and row.get("alive", True) for row in rows)

    wait_until(listed, TIMEOUT, f"worker {worker_id} registered")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    serving = DaemonProcess([], tmp_path / "daemon", workers=1)
    serving.start()
    try:
        yield serving
    finally:
        serving.stop()


def test_a_second_serve_on_the_data_dir_refuses_naming_the_holder_and_the_first_serves(
    daemon: DaemonProcess,
) -> None:
    run_to_completion(daemon, "before")
    server_pid = embedded_nats_pid(daemon)
    files = written_at_start(daemon)

    second = serve_again(daemon.data_dir)

    assert second.returncode == 1, (second.returncode, second.stdout, second.stderr)
    message = flat(second.stderr)
    assert "data_dir_in_use" in message, message
    assert f"data dir {daemon.data_dir} is in use by apomesh serve pid {daemon.pid}" in message
    assert "serving on" not in second.stdout, second.stdout
    # Nothing a start writes was written again; the first daemon's embedded server was left
    # alone, and it still serves reads and sessions.
    assert written_at_start(daemon) == files
    assert embedded_nats_pid(daemon) == server_pid
    healthy(daemon)
    run_to_completion(daemon, "after the refused second serve")


def test_a_sigkilled_daemons_data_dir_is_served_again_at_once(daemon: DaemonProcess) -> None:
    run_to_completion(daemon, "before the kill")
    dead = daemon.pid
    daemon.kill()
    # What the killed daemon left behind blocks nobody.
    daemon.start()
    assert daemon.pid != dead
    healthy(daemon)
    run_to_completion(daemon, "after the kill")
    # And the data dir is the new daemon's now: a third serve is refused naming it, not the dead.
    third = serve_again(daemon.data_dir)
    assert third.returncode == 1, (third.returncode, third.stdout, third.stderr)
    assert f"in use by apomesh serve pid {daemon.pid}" in flat(third.stderr), third.stderr


@pytest.mark.parametrize("ending", ["SIGTERM", "SIGKILL"])
def test_the_embedded_port_is_kept_and_a_worker_process_reconnects_after_a_restart(
    tmp_path: Path, ending: str
) -> None:
    daemon = DaemonProcess([], tmp_path / "daemon", workers=0)
    daemon.start()
    credentials = daemon.data_dir / "credentials" / "worker-1.toml"
    worker = WorkerProcess([], daemon.workspace, "remote", config=credentials)
    worker.start()
    try:
        url = embedded_url(daemon)
        wait_registered(daemon, "worker-1")
        assert run_to_completion(daemon, "first")["agents"][0]["worker"] == "worker-1"

        if ending == "SIGKILL":
            daemon.kill()  # its embedded server gets SIGTERM as its parent dies
        else:
            daemon.stop()
        daemon.start()

        assert embedded_url(daemon) == url
        assert f"NATS {url}" in flat(daemon.output_tail())
        # The worker was never restarted: its client reconnects to the same URL with the same
        # credentials and it registers with the new daemon by itself.
        assert worker.proc.poll() is None, worker.log_file.read_text()
        wait_registered(daemon, "worker-1")
        view = run_to_completion(daemon, "after the restart")
        assert view["agents"][0]["worker"] == "worker-1", (view, worker.log_file.read_text())
    finally:
        worker.stop()
        daemon.stop()


def test_a_kept_port_another_process_took_is_refused_by_its_number(tmp_path: Path) -> None:
    daemon = DaemonProcess([], tmp_path / "daemon", workers=0)
    daemon.start()
    port = int(embedded_url(daemon).rsplit(":", 1)[1])
    daemon.stop()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        refused = serve_again(daemon.data_dir)
    assert refused.returncode == 1, (refused.returncode, refused.stdout, refused.stderr)
    message = flat(refused.stderr)
    assert "nats_port_taken" in message and f"port {port}" in message, message
    assert "[nats] embedded_port" in message, message


def test_a_configured_port_wins_and_is_kept(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        configured = probe.getsockname()[1]
    daemon = DaemonProcess([], tmp_path / "daemon", workers=0)
    daemon.start()
    first = embedded_url(daemon)
    daemon.stop()
    assert not first.endswith(f":{configured}")

    daemon.env["APOMESH_NATS_EMBEDDED_PORT"] = str(configured)
    daemon.start()
    assert embedded_url(daemon) == f"nats://127.0.0.1:{configured}"
    daemon.stop()

    # Without the setting, the port it was last given is the one it keeps.
    del daemon.env["APOMESH_NATS_EMBEDDED_PORT"]
    daemon.start()
    try:
        assert embedded_url(daemon) == f"nats://127.0.0.1:{configured}"
        healthy(daemon)
    finally:
        daemon.stop()
