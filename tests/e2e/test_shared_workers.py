"""Workers shared by several daemons on one NATS, on real processes: ``apomesh serve`` daemons
with their own data dirs and ``apomesh worker`` processes on one nats-server.

A second daemon, started and then SIGKILLed and started again (a new incarnation), leaves the
first one's running dispatch alone (its session runs to completion, with no re-dispatch), and
both daemons' sessions run on the same worker process; a worker started with
``--max-agents 1`` never runs two agents at once, for one daemon's fan-out or two daemons
together (a daemon waits for room, visibly); a worker whose daemon is killed abandons that
daemon's dispatch once it stops answering, so its slot serves another daemon.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.test_probes import holding

from apomesh.adapters.natsserver import NatsServer
from apomesh.sdk.client import EventRecord, SyncClient
from apomesh.testing import DaemonProcess, WorkerProcess

TIMEOUT = 60.0
ENDED = ("completed", "failed", "cancelled")


def slow_agent(name: str, steps: int, delay: float) -> dict[str, Any]:
    """An agent that lists its workspace ``steps`` times, ``delay`` seconds apart, then answers."""
    turns: list[dict[str, Any]] = [
        {"delay": delay, "tool_calls": [{"tool": "fs.list", "args": {"path": "."}}]}
        for _ in range(steps)
    ]
    turns.append({"final": f"{name} done"})
    return {
        "name": name,
        "version": "1",
        "tools": ["fs.list"],
        "model": {"provider": "scripted", "turns": turns},
    }


def gated_writer(path: str) -> dict[str, Any]:
    """An agent that writes ``path`` once (its fs.write waits while the test holds the file's
    lock), then answers."""
    call = {"tool": "fs.write", "args": {"path": path, "content": "first"}}
    return {
        "name": "gated",
        "version": "1",
        # The test holds a file's lock in the shared workspace before the session exists.
        "workspace": "shared",
        "tools": ["fs.write"],
        "model": {
            "provider": "scripted",
            "turns": [{"tool_calls": [call]}, {"final": "first done"}],
        },
    }


def fanout(name: str, parts: int, delay: float) -> dict[str, Any]:
    """A planner whose ``parts`` sub-agents may all run at once, each a ``slow_agent``."""
    worker = slow_agent(f"{name}-part", 2, delay)
    return {
        "name": name,
        "version": "1",
        "coordination": "fanout",
        "coordination_params": {"max_parallel": parts},
        "model": {
            "provider": "scripted",
            "turns": [{"plan": [f"part {n}" for n in range(parts)]}, {"final": f"{name} done"}],
        },
        "roles": {"worker": {"tools": worker["tools"], "model": worker["model"]}},
    }


def start(url: str, goal: str, definition: dict[str, Any]) -> str:
    response = httpx.post(f"{url}/v1/sessions", json={"goal": goal, "definition": definition})
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


def wait_for(what: str, probe: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"never {what}")


def view(url: str, session_id: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/v1/sessions/{session_id}").json()
    return body


def wait_ended(url: str, session_id: str) -> dict[str, Any]:
    ended: dict[str, Any] = wait_for(
        f"ended {session_id} on {url}",
        lambda: (v := view(url, session_id))["status"] in ENDED and v,
    )
    return ended


def workers(url: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = httpx.get(f"{url}/v1/workers").json()["workers"]
    return [row for row in rows if row.get("alive", True)]


def the_worker(url: str) -> str:
    """The id of the one live worker the daemon at ``url`` lists, once it does."""
    rows: list[dict[str, Any]] = wait_for(f"a worker on {url}", lambda: workers(url))
    assert len(rows) == 1, rows
    return str(rows[0]["id"])


def log_of(url: str, session_id: str) -> list[EventRecord]:
    with SyncClient(url) as client:
        return list(client.events(session_id))


def dispatched_to(records: list[EventRecord]) -> set[str]:
    return {
        r.event["worker"]
        for r in records
        if r.kind == "AgentLifecycle" and r.event["phase"] == "dispatched"
    }


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


def concurrency(worker: WorkerProcess) -> list[tuple[int, int]]:
    """(agents running, capacity) each time the worker took a dispatch, from its log."""
    text = worker.log_file.read_text(errors="replace")
    return [(int(n), int(m)) for n, m in re.findall(r": (\d+) of (\d+) agents\n", text)]


@pytest.fixture
def daemons(fresh_nats_server: NatsServer, tmp_path: Path) -> Iterator[list[DaemonProcess]]:
    """Two daemons (not started) on one nats-server, each with its own data dir."""
    pair = [DaemonProcess([fresh_nats_server.url], tmp_path / name) for name in ("a", "b")]
    try:
        yield pair
    finally:
        for daemon in pair:
            daemon.stop()


def shared_worker(
    server: NatsServer, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[WorkerProcess]:
    worker = WorkerProcess([server.url], tmp_path / "workspace", "shared", env, extra_args=args)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def worker(fresh_nats_server: NatsServer, tmp_path: Path) -> Iterator[WorkerProcess]:
    yield from shared_worker(fresh_nats_server, tmp_path)


@pytest.fixture
def one_slot_worker(fresh_nats_server: NatsServer, tmp_path: Path) -> Iterator[WorkerProcess]:
    yield from shared_worker(
        fresh_nats_server,
        tmp_path,
        "--max-agents",
        "1",
        env={"APOMESH_WORKERS_DAEMON_GONE_AFTER": "1"},
    )


def test_other_daemons_starting_and_restarting_leave_the_first_daemons_dispatch_running(
    daemons: list[DaemonProcess], worker: WorkerProcess
) -> None:
    first, second = daemons
    first.start()
    worker_id = the_worker(first.url)
    gate = "gate.txt"
    with holding(worker.workspace, gate) as release:
        # The first daemon's agent waits inside its fs.write (the test holds the file's lock)
        # until released: its dispatch is running on the worker all the while.
        gated = start(first.url, "the first daemon's", gated_writer(gate))
        wait_for(
            "the first daemon's agent inside its tool",
            lambda: f"fs.write waits for the lock of {gate}" in worker.log_file.read_text(),
        )
        second.start()
        # The same worker process serves the second daemon too...
        assert the_worker(second.url) == worker_id
        ran_on_second = [start(second.url, "the second daemon's", slow_agent("second", 2, 0.1))]
        assert wait_ended(second.url, ran_on_second[0])["status"] == "completed"
        # ...and a new incarnation of it (SIGKILLed, started again on its data dir).
        second.kill()
        second.start()
        assert the_worker(second.url) == worker_id
        ran_on_second.append(start(second.url, "again", slow_agent("second", 2, 0.1)))
        assert wait_ended(second.url, ran_on_second[1])["status"] == "completed"
        assert view(first.url, gated)["status"] == "running"
        release()
        ended = wait_ended(first.url, gated)
    assert (ended["status"], ended["output"]) == ("completed", "first done"), ended
    assert (worker.workspace / gate).read_text() == "first"
    first_log = log_of(first.url, gated)
    # Never abandoned, so never dispatched again.
    assert "AgentResuming" not in [r.kind for r in first_log]
    assert dispatched_to(first_log) == {worker_id}
    for session_id in ran_on_second:
        assert dispatched_to(log_of(second.url, session_id)) == {worker_id}
    assert "abandoning" not in worker.log_file.read_text(errors="replace")


def test_a_worker_with_max_agents_1_never_runs_two_agents_at_once(
    daemons: list[DaemonProcess], one_slot_worker: WorkerProcess
) -> None:
    first, second = daemons
    first.start()
    second.start()
    worker_id = the_worker(first.url)
    assert the_worker(second.url) == worker_id
    # One daemon's fan-out: three sub-agents that may all run at once get one slot.
    spread = start(first.url, "three parts", fanout("spread", 3, 0.2))
    # The second daemon hears from the worker's beats that it is busy, and waits for room.
    wait_for(
        "the second daemon seeing the worker busy",
        lambda: any(row["agents"] for row in workers(second.url)),
    )
    waiting = start(second.url, "after them", slow_agent("waiting", 2, 0.1))
    wait_for(
        "the second daemon waiting",
        lambda: metric(second.url, "apomesh_placement_waits_total") >= 1,
    )
    assert "waits for room on a worker" in second.output_tail(1_000_000)

    for url, session_id in ((first.url, spread), (second.url, waiting)):
        ended = wait_ended(url, session_id)
        assert ended["status"] == "completed", ended
    assert metric(first.url, "apomesh_placement_waits_total") >= 1  # its own sub-agents waited
    taken = concurrency(one_slot_worker)
    assert len(taken) >= 5, taken  # the planner, its answer, three parts and the other session
    assert set(taken) == {(1, 1)}, taken


def test_a_worker_abandons_the_dispatch_of_a_daemon_that_stopped_answering(
    daemons: list[DaemonProcess], one_slot_worker: WorkerProcess
) -> None:
    first, second = daemons
    first.start()
    second.start()
    worker_id = the_worker(first.url)
    assert the_worker(second.url) == worker_id
    start(first.url, "never finished", slow_agent("killed", 50, 0.3))
    wait_for(
        "the first daemon's agent on the worker",
        lambda: any(row["agents"] for row in workers(second.url)),
    )
    first.kill()
    # Its only slot taken by a dead daemon's dispatch, the worker would never run this one.
    after = start(second.url, "after the kill", slow_agent("after", 2, 0.1))
    ended = wait_ended(second.url, after)
    assert ended["status"] == "completed", ended
    assert dispatched_to(log_of(second.url, after)) == {worker_id}
    text = one_slot_worker.log_file.read_text(errors="replace")
    assert re.search(r"abandoning .* daemon \S+ has not answered", text), text[-3000:]
