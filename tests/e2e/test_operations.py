"""What an operator relies on, on real processes (nats-server, ``apomesh serve``, a worker process,
the ``apomesh`` command): ``Idempotency-Key`` on ``POST /v1/sessions`` answering the same session
across a daemon restart; retention (``apomesh sessions purge`` by id and by age, the daemon's own
sweep at boot) removing an ended session's events and records, with the boot scan counting what is
left; and health that tells the truth when the only worker is gone (the session's agent waits for a
capable worker, ``/healthz`` says degraded).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from apomesh.sdk.client import SyncClient
from apomesh.testing import Mesh

T = TypeVar("T")
JSON = {"Content-Type": "application/json"}
ASKER = {
    "name": "asker",
    "version": "1.0.0",
    "coordination": "solo",
    "tools": ["ask_human"],
    "model": {
        "provider": "scripted",
        "turns": [
            {"tool_calls": [{"tool": "ask_human", "args": {"question": "Keep me?"}}]},
            {"final": "kept"},
        ],
    },
}
SLOW = {
    "name": "slow",
    "version": "1.0.0",
    "coordination": "solo",
    "tools": ["fs.list"],
    "model": {"provider": "scripted", "turns": [{"delay": 5.0, "final": "slept"}]},
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    from apomesh.adapters.natsserver import NatsServer, single_node

    base = tmp_path_factory.mktemp("operations")
    server = NatsServer(single_node(base, name="nats"))
    server.start()
    system = Mesh(server, base)
    try:
        system.daemon.start()
        system.worker()
        system.wait_workers(1)
        yield system
    finally:
        system.close()
        server.stop()


def apomesh(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The command as a script runs it: stdin is not a terminal."""
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("APOMESH_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "apomesh", *args, "--url", url],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def wait_until(check: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def restart(mesh: Mesh, **env: str) -> dict[str, Any]:
    """Restart the daemon (with ``env`` added to its environment); its boot scan's numbers."""
    mesh.daemon.env.update(env)
    mesh.daemon.restart()
    mesh.wait_workers(1)
    return dict(httpx.get(f"{mesh.url}/healthz").json()["boot"])


def ended_ids(client: SyncClient) -> set[str]:
    return {
        s.session_id
        for s in client.list_sessions(limit=1000)
        if s.status in ("completed", "failed", "cancelled")
    }


def test_the_same_idempotency_key_answers_the_same_session_across_a_restart(mesh: Mesh) -> None:
    body = {"goal": "exactly once"}
    with httpx.Client(base_url=mesh.url, headers=JSON) as http:
        first = http.post("/v1/sessions", json=body, headers={"Idempotency-Key": "order-17"})
        assert first.status_code == 201, first.text
        session_id = first.json()["session_id"]
        again = http.post("/v1/sessions", json=body, headers={"Idempotency-Key": "order-17"})
        assert again.status_code == 201 and again.json()["session_id"] == session_id
        other = http.post(
            "/v1/sessions", json={"goal": "another"}, headers={"Idempotency-Key": "order-17"}
        )
        assert other.status_code == 409 and other.json()["error"] == "idempotency_conflict"
        too_long = http.post("/v1/sessions", json=body, headers={"Idempotency-Key": "k" * 300})
        assert too_long.status_code == 400
    with SyncClient(mesh.url) as client:
        assert client.wait(session_id, timeout=60).status == "completed"

    restart(mesh)
    with SyncClient(mesh.url) as client:
        assert client.start_session("exactly once", idempotency_key="order-17") == session_id
        ran = apomesh(mesh.url, "run", "exactly once", "--idempotency-key", "order-17")
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.split() == ["session", session_id]
        assert [s.session_id for s in client.list_sessions(query="exactly once")] == [session_id]


def test_purge_removes_ended_sessions_and_the_boot_scan_counts_what_is_left(mesh: Mesh) -> None:
    with SyncClient(mesh.url) as client:
        by_id, by_age, at_boot = (client.start_session(f"purge {n}") for n in range(3))
        for session_id in (by_id, by_age, at_boot):
            assert client.wait(session_id, timeout=60).status == "completed"
        paused = client.start_session("stay paused", definition=ASKER)
        wait_until(lambda: client.get_session(paused).hitl_pending, "the pause")

        # One session by id: refused without a terminal to ask, done with --yes.
        refused = apomesh(mesh.url, "sessions", "purge", by_id)
        assert refused.returncode == 2 and "--yes" in refused.stderr
        assert client.get_session(by_id).status == "completed"
        purged = apomesh(mesh.url, "sessions", "purge", by_id, "--yes")
        assert purged.returncode == 0, purged.stderr
        for path in (f"/v1/sessions/{by_id}", f"/v1/sessions/{by_id}/events"):
            assert httpx.get(f"{mesh.url}{path}").status_code == 404
        assert by_id not in {s.session_id for s in client.list_sessions(limit=1000)}
        not_ended = apomesh(mesh.url, "sessions", "purge", paused, "--yes")
        assert not_ended.returncode == 1 and "command_refused" in not_ended.stderr
        assert client.get_session(paused).status == "paused"

        # Every session ended more than a second ago: by_age (and whatever else has ended).
        before = ended_ids(client)
        cutoff = client.get_session(by_age).updated_at + 1.0
        wait_until(lambda: time.time() > cutoff + 0.1, "a second to pass")
        bulk = apomesh(mesh.url, "sessions", "purge", "--ended-before", "1s", "--yes")
        assert bulk.returncode == 0, bulk.stderr
        assert f"purged {by_age}" in bulk.stdout and paused not in bulk.stdout
        assert by_age in before and by_age not in ended_ids(client)
        # The key of a purged session went with it: the same request starts a new session.
        again = client.start_session("exactly once", idempotency_key="order-17")
        assert again not in before and client.wait(again, timeout=60).status == "completed"

        # The daemon's own sweep at boot ([retention] ended_after), before the scan counts.
        done = client.start_session("purge at boot")
        assert client.wait(done, timeout=60).status == "completed"
        expired = ended_ids(client)
        assert done in expired and at_boot not in expired  # at_boot went with the bulk purge
        ended_at = client.get_session(done).updated_at
        wait_until(lambda: time.time() > ended_at + 1.1, "a second to pass")
    boot = restart(mesh, APOMESH_RETENTION_ENDED_AFTER="1s")
    assert boot["purged"] == len(expired), boot
    assert boot["completed_skipped"] == 0 and boot["terminal"] == 0, boot
    with SyncClient(mesh.url) as client:
        assert ended_ids(client) == set()
        assert httpx.get(f"{mesh.url}/v1/sessions/{done}").status_code == 404
        assert client.get_session(paused).status == "paused"
        pause = client.get_session(paused).hitl_pending[0]
        client.answer_hitl(paused, pause.pause_id, "yes")
        assert client.wait(paused, timeout=60).status == "completed"
    boot = restart(mesh, APOMESH_RETENTION_ENDED_AFTER="")
    assert boot["purged"] == 0 and boot["completed_skipped"] == 1, boot


def test_health_tells_the_truth_when_the_only_worker_is_lost(mesh: Mesh) -> None:
    with SyncClient(mesh.url) as client:
        assert client.health()["status"] == "ok"
        session_id = client.start_session("outlive my worker", definition=SLOW)

        def dispatched() -> Any:
            root = client.get_session(session_id).agents[0]
            return root if root.worker and root.phase in ("dispatched", "running") else None

        lost = wait_until(dispatched, "the agent to be dispatched").worker
        for worker in mesh.workers:
            worker.kill()

        def waiting() -> Any:
            root = client.get_session(session_id).agents[0]
            return root if root.waiting_for else None

        root = wait_until(waiting, "the agent to wait for a worker")
        assert root.waiting_for == f"a capable worker; {lost} was lost"
        health = client.health()
        assert health["status"] == "degraded" and health["ok"] is True
        assert "no live worker" in health["problems"]
        assert health["waiting_for_worker"] == 1 and health["workers"] == 0
        shown = apomesh(mesh.url, "sessions", "show", session_id)
        assert f"waiting for a capable worker; {lost} was lost" in shown.stdout
        listed = apomesh(mesh.url, "workers", "list")
        assert any(
            lost in line and "lost" in line.split(lost, 1)[1] for line in listed.stdout.splitlines()
        )

        mesh.worker()
        mesh.wait_workers(1)
        assert client.wait(session_id, timeout=90).status == "completed"
        assert client.health()["status"] == "ok"


PROBE = """
def test_console_probe(page):
    pass
"""
PLAIN = """
def test_plain_probe():
    pass
"""


def test_a_run_without_chromium_stops_at_once_with_the_command_to_install_it() -> None:
    """As a user who is not root, on a machine without the browser: the console tests do not
    error one by one, the run stops before any test with the exact command; a run of tests that
    need no browser goes on."""
    import shutil
    import tempfile

    root = Path(__file__).parents[2]
    probes = Path(tempfile.mkdtemp(prefix="apomesh-probe-"))
    try:
        probes.chmod(0o755)
        (probes / "test_console_probe.py").write_text(PROBE)
        (probes / "test_plain_probe.py").write_text(PLAIN)
        env = {
            **os.environ,
            "APOMESH_CHROMIUM": str(probes / "no-chromium-here"),
            "PYTHONPATH": str(root),
            "HOME": str(probes),
        }

        def pytest_as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
            # The run as a user who is not root (uid 65534): the interpreter is told so, as the
            # virtual environment may sit in a directory another user cannot enter.
            as_nobody = (
                "import os, sys, pytest; os.geteuid = lambda: 65534;"
                " sys.exit(pytest.main(sys.argv[1:]))"
            )
            return subprocess.run(
                [
                    sys.executable,
                    "-c",
                    as_nobody,
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-p",
                    "tests.conftest",
                    "--rootdir",
                    str(probes),
                    *args,
                ],
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
                cwd=root,
            )

        stopped = pytest_as_nobody(str(probes))
        output = stopped.stdout + stopped.stderr
        assert stopped.returncode == 4, output
        assert "sudo apt-get install -y --no-install-recommends chromium" in output
        assert "passed" not in output and "test_console_probe" not in output
        plain = pytest_as_nobody(str(probes / "test_plain_probe.py"))
        assert plain.returncode == 0 and "1 passed" in plain.stdout, plain.stdout + plain.stderr
    finally:
        shutil.rmtree(probes, ignore_errors=True)


FAKE_APT_GET = """#!/bin/sh
# apt-get on a fresh machine: no package lists until `update`, then `install` provides chromium.
echo "$*" >> "$APT_LOG"
case "$1" in
  update) touch "$APT_LISTS"; exit 0 ;;
  install) [ -e "$APT_LISTS" ] || { echo "E: Unable to locate package chromium" >&2; exit 100; }
           touch "$APOMESH_CHROMIUM"; exit 0 ;;
esac
exit 1
"""


def test_a_root_run_without_chromium_installs_it_before_any_test(tmp_path: Path) -> None:
    """As root on a fresh machine (no chromium, no package lists yet): the run installs the
    package, reading the package lists when the first try finds none, before any test starts."""
    root = Path(__file__).parents[2]
    probes = tmp_path / "probes"
    probes.mkdir()
    (probes / "test_console_probe.py").write_text(PROBE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apt_get = bin_dir / "apt-get"
    apt_get.write_text(FAKE_APT_GET)
    apt_get.chmod(0o755)
    env = {
        **os.environ,
        "APOMESH_CHROMIUM": str(tmp_path / "chromium"),
        "APT_LOG": str(tmp_path / "apt.log"),
        "APT_LISTS": str(tmp_path / "lists"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(root),
    }
    collected = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider"),
            *("-p", "tests.conftest", "--rootdir", str(probes), str(probes)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=root,
    )
    output = collected.stdout + collected.stderr
    assert collected.returncode == 0, output
    assert "installing Debian's chromium" in output
    assert (tmp_path / "apt.log").read_text().splitlines() == [
        "install -y --no-install-recommends chromium",
        "update",
        "install -y --no-install-recommends chromium",
    ]
    assert (tmp_path / "chromium").exists()
