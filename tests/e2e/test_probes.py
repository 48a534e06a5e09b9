"""Exactly once through kills, on real processes: the file tools' probes and epoch fencing.

A worker killed with SIGKILL between a call's logged intent and its effect leaves an unknown
outcome; the resumed agent's worker asks ``fs.append``'s (or ``fs.write``'s) probe, which finds
that the effect never happened, and the call runs once: the line is in its file once, not zero
times, not twice. Killed between the effect and its result, the probe finds that it happened and
its result is served. A worker frozen (SIGSTOP) inside ``fs.write`` past the heartbeat threshold,
whose agent was resumed elsewhere and went on to write newer content, cannot land its stale write
when it thaws. A tool without a probe still follows its ``on_unknown`` policy, and the operator
sees its unknown outcome before resuming.

The kill points are exact, not raced: the test holds the target file's ledger lock (the lock the
file tools change a file under), so the worker waits inside the tool, after its intent is on the
log and before its effect, until the test lets it go or kills it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from tests.e2e.chaos_kit import WorkerPool, check_session, shape_of, stored_session
from tests.e2e.plane_support import PROBE_PROJECT
from tests.e2e.test_recovery import finished, restart, write_log

from apomesh.builtin.tools import BUILTIN_TOOLS, ledger_lock_path
from apomesh.core import envelope
from apomesh.core.events import ToolCallIntent
from apomesh.core.journal import call_key, idempotency_key
from apomesh.sdk.client import Client, EventRecord
from apomesh.testing import Mesh, WorkerProcess, install_plugin_package

TOOLS = {tool.name: tool for tool in BUILTIN_TOOLS}


@pytest.fixture(scope="module", autouse=True)
def probe_plugin() -> None:
    """``pinprobe.mark``, a side-effecting tool without a probe, in every process of the mesh."""
    install_plugin_package(PROBE_PROJECT)


@contextlib.contextmanager
def holding(workspace: Path, path: str) -> Iterator[Any]:
    """The ledger lock of the workspace file ``path`` held by the test until ``release()``."""
    (workspace / path).parent.mkdir(parents=True, exist_ok=True)
    lock = ledger_lock_path(workspace, path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held = {"fd": fd}

    def release() -> None:
        if held["fd"] >= 0:
            os.close(held["fd"])
            held["fd"] = -1

    try:
        yield release
    finally:
        release()


async def inside_the_tool(worker: WorkerProcess, tool: str, path: str) -> None:
    """Until ``worker`` logs that its ``tool`` call waits for the lock of ``path``."""
    with anyio.fail_after(30):
        while f"{tool} waits for the lock of {path}" not in worker.log_file.read_text():
            await anyio.sleep(0.05)


def solo(tool: str, args: list[dict[str, Any]]) -> dict[str, Any]:
    """A solo agent making one ``tool`` call per turn with each of ``args``, then answering."""
    turns: list[dict[str, Any]] = [{"tool_calls": [{"tool": tool, "args": a}]} for a in args]
    return {
        "name": "probed",
        "version": "1.0.0",
        "coordination": "solo",
        # The test holds a file's lock in the shared workspace before the session exists.
        "workspace": "shared",
        "tools": [tool],
        "model": {"provider": "scripted", "turns": [*turns, {"final": "done"}]},
    }


class StandIn:
    """The ``ToolContext`` of the killed worker's dispatch, for running its effect after it died
    (as if it had done the effect and died before reporting it)."""

    def __init__(self, workspace: Path, session_id: str, epoch: int, key: str) -> None:
        self.workspace = workspace
        self.session_id = session_id
        self.agent = "root"
        self.epoch = epoch
        self.call_key = key
        self.idempotency_key = idempotency_key(session_id, self.agent, key)


async def run_to_end(
    client: Client, session_id: str, on_record: Any, deadline: float = 90.0
) -> list[EventRecord]:
    records: list[EventRecord] = []
    with anyio.fail_after(deadline):
        async for record in client.events(session_id):
            records.append(record)
            await on_record(record)
            if record.kind == "SessionEnded":
                break
    return records


def of_kind(records: list[EventRecord], kind: str) -> list[dict[str, Any]]:
    return [r.event for r in records if r.kind == kind]


CALLS = {
    "fs.append": lambda path, n: {"path": path, "line": f"line {n}"},
    "fs.write": lambda path, n: {"path": f"{path}.{n}", "content": f"content {n}"},
}


def written(workspace: Path, tool: str, path: str, n: int) -> int:
    """How many times call ``n`` of ``tool`` is in its file (a write: 1 when it holds it)."""
    if tool == "fs.append":
        target = workspace / path
        lines = target.read_text().splitlines() if target.exists() else []
        return lines.count(f"line {n}")
    target = workspace / f"{path}.{n}"
    return int(target.exists() and target.read_text() == f"content {n}")


@pytest.mark.anyio
@pytest.mark.parametrize("tool", ["fs.append", "fs.write"])
@pytest.mark.parametrize("point", ["before_effect", "after_effect"])
async def test_a_worker_killed_around_the_effect_leaves_it_done_exactly_once(
    mesh: Mesh, tool: str, point: str
) -> None:
    workspace = mesh.daemon.workspace
    path = f"probe/{tool}-{point}-{uuid.uuid4().hex[:6]}.txt"
    calls = [CALLS[tool](path, n) for n in range(2)]
    target = path if tool == "fs.append" else calls[0]["path"]
    pool = WorkerPool(mesh)
    worker_of: dict[str, str] = {}
    epoch_of: dict[str, int] = {}
    killed: list[str] = []
    async with Client(mesh.url) as client:
        with holding(workspace, target) as release:
            session_id = await client.start_session("probed", definition=solo(tool, calls))

            async def on_record(record: EventRecord) -> None:
                ev = record.event
                if record.kind == "AgentLifecycle" and ev.get("phase") == "dispatched":
                    worker_of[ev["agent"]], epoch_of[ev["agent"]] = ev["worker"], ev["epoch"]
                if record.kind == "ToolCallIntent" and not killed:
                    # The worker waits for the lock inside the tool: its effect has not happened.
                    worker = pool.by_id(worker_of["root"])
                    assert worker is not None
                    await inside_the_tool(worker, tool, target)
                    killed.append(worker_of["root"])
                    if point == "before_effect":
                        worker.kill()
                        release()
                        return
                    # The effect happens, as that dispatch would have done it, and its worker
                    # dies before reporting the result.
                    worker.freeze()
                    release()
                    stand_in = StandIn(workspace, session_id, epoch_of["root"], ev["key"])
                    await TOOLS[tool].run(stand_in, ev["args"])
                    worker.kill()

            records = await run_to_end(client, session_id, on_record)
        verification = await client.verify_session(session_id)
    check = check_session(records, verification, workspace)
    assert check.ok, check.problems
    assert killed and of_kind(records, "AgentResuming"), "the worker was never killed and resumed"
    for n in range(2):
        assert written(workspace, tool, path, n) == 1, f"call {n} of {tool} is not there once"
    first = calls[0]
    key = call_key(tool, first)
    intents = [e for e in of_kind(records, "ToolCallIntent") if e["key"] == key]
    results = [e for e in of_kind(records, "ToolCallRecorded") if e["key"] == key]
    assert [r["outcome"] for r in results] == ["ok"], results  # never "unknown"
    if point == "before_effect":
        # The probe found it never happened: a second intent (same key) and the call ran once.
        assert [i.get("resolution", "") for i in intents] == ["", "not_happened"]
        assert results[0].get("resolved_by", "") == ""
    else:
        # The probe found it happened: its result is served, the call is not run again.
        assert len(intents) == 1
        assert results[0]["resolved_by"] == "probe"
    final = of_kind(records, "SessionEnded")[-1]
    assert final["status"] == "completed" and final["output"] == "done"


@pytest.mark.anyio
async def test_a_frozen_worker_cannot_land_its_stale_write_after_its_agent_moved_on(
    mesh: Mesh,
) -> None:
    workspace = mesh.daemon.workspace
    path = f"zombie/config-{uuid.uuid4().hex[:6]}.txt"
    calls = [{"path": path, "content": "X"}, {"path": path, "content": "Y"}]
    pool = WorkerPool(mesh)
    worker_of: dict[str, str] = {}
    frozen: list[Any] = []
    async with Client(mesh.url) as client:
        with holding(workspace, path) as release:
            session_id = await client.start_session("zombie", definition=solo("fs.write", calls))

            async def on_record(record: EventRecord) -> None:
                ev = record.event
                if record.kind == "AgentLifecycle" and ev.get("phase") == "dispatched":
                    worker_of[ev["agent"]] = ev["worker"]
                if record.kind == "ToolCallIntent" and not frozen:
                    # Frozen inside fs.write(X), before its write: past the heartbeat threshold
                    # its agent is resumed on the other worker, which writes X, then Y.
                    worker = pool.by_id(worker_of["root"])
                    assert worker is not None
                    await inside_the_tool(worker, "fs.write", path)
                    worker.freeze()
                    frozen.append(worker)
                    release()

            records = await run_to_end(client, session_id, on_record)
        assert (workspace / path).read_text() == "Y"
        zombie = frozen[0]
        zombie.thaw()  # SIGCONT: it wakes inside fs.write(X) and tries its stale write
        deadline = time.monotonic() + 20
        while "is stale and does not change it" not in zombie.log_file.read_text():
            if time.monotonic() > deadline:
                raise AssertionError(
                    "the thawed worker never tried its write: " + zombie.log_file.read_text()
                )
            await anyio.sleep(0.1)
        verification = await client.verify_session(session_id)
    assert (workspace / path).read_text() == "Y", "the zombie's stale write landed over Y"
    check = check_session(records, verification, workspace)
    assert check.ok, check.problems
    x_key = call_key("fs.write", calls[0])
    assert [
        e.get("resolution", "") for e in of_kind(records, "ToolCallIntent") if e["key"] == x_key
    ] == ["", "not_happened"]
    assert of_kind(records, "SessionEnded")[-1]["status"] == "completed"


@pytest.mark.anyio
async def test_a_tool_without_a_probe_follows_on_unknown_and_the_operator_sees_it(
    mesh: Mesh,
) -> None:
    goal = "no-probe"
    append = {"path": f"chaos/{goal}.txt", "line": f"{goal} appended"}
    mark = {"path": f"chaos/{goal}-marks.txt", "line": f"{goal} marked"}
    definition = {
        "name": "mixed",
        "version": "1.0.0",
        "coordination": "solo",
        "workspace": "shared",
        "tools": ["fs.append", "pinprobe.mark"],
        "model": {
            "provider": "scripted",
            "turns": [
                {"tool_calls": [{"tool": "fs.append", "args": append}]},
                {"tool_calls": [{"tool": "pinprobe.mark", "args": mark}]},
                {"final": "done"},
            ],
        },
    }
    session_id = uuid.uuid4().hex
    # The daemon died with both calls' intents logged and neither result heard.
    log = stored_session(
        session_id, shape_of(definition), goal=goal, events=5, open_intent=("fs.append", append)
    )
    mark_intent = ToolCallIntent("root", call_key("pinprobe.mark", mark), "pinprobe.mark", mark)
    log.append(
        envelope.make(session_id, len(log), log[-1].ts + 0.01, uuid.uuid4().hex, mark_intent)
    )
    await write_log(mesh.nats_url, log)
    await restart(mesh)
    async with Client(mesh.url) as client:
        preview = await client.recovery_preview(session_id)
        # Before resuming, the operator sees both as unknown.
        assert sorted(u.tool for u in preview.unknown_outcomes) == ["fs.append", "pinprobe.mark"]
        await client.resume(session_id, confirm=True)
        records = await finished(client, session_id)
        verification = await client.verify_session(session_id)
        view = await client.get_session(session_id)
    check = check_session(records, verification, mesh.daemon.workspace)
    assert check.ok, check.problems
    recorded = {e["tool"]: e for e in of_kind(records, "ToolCallRecorded")}
    # fs.append has a probe: it found the line was never appended, so it ran, once.
    assert recorded["fs.append"]["outcome"] == "ok"
    lines = (mesh.daemon.workspace / append["path"]).read_text().splitlines()
    assert lines.count(append["line"]) == 1
    # pinprobe.mark has none: its policy ("fail") decides, it is not run again, the model is
    # told, and the unresolved outcome stays visible on the session.
    assert recorded["pinprobe.mark"]["outcome"] == "unknown"
    assert "not re-run" in recorded["pinprobe.mark"]["result"]
    assert not (mesh.daemon.workspace / mark["path"]).exists()
    assert view.status == "completed"
    assert [u.tool for u in view.unknown_outcomes] == ["pinprobe.mark"]
