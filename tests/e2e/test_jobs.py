"""Async jobs end to end on real processes (an ``apomesh serve`` daemon, ``apomesh worker``
processes, a real nats-server): jobs are named by their agent, so two fanout children making the
same job call each get their own job and their own result, the log folds and nobody is
re-dispatched in a loop; a job whose tool declares a side effect is a journaled effect, so a job in
flight when the daemon is SIGKILLed is never run again by the next daemon: the session waits on
the recoverable list with the job as an unknown outcome, and an operator's resume fails the job
(the agent sees why) instead of running it a second time.

The side-effecting jobs come from the test-only ``apomesh-jobprobe`` plugin (``tests/e2e/jobprobe``),
installed into the environment before the daemon and workers start; every run of its
``probe.deploy`` appends one line to ``deploys.log`` in the workspace.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tests.e2e.test_runtime import kinds, log_of, start, view, wait_ended, wait_until

from apomesh.core.envelope import make
from apomesh.core.events import Event
from apomesh.core.state import fold
from apomesh.sdk.client import EventRecord, SyncClient
from apomesh.testing import Mesh, install_plugin_package

JOBPROBE = Path(__file__).resolve().parent / "jobprobe"
TIMEOUT = 60.0


@pytest.fixture(scope="module", autouse=True)
def jobprobe_installed() -> None:
    # Before any daemon or worker process starts: they load it through the entry points.
    install_plugin_package(JOBPROBE)


def scripted(turns: list[dict[str, Any]]) -> dict[str, Any]:
    return {"provider": "scripted", "turns": turns}


def sleepers(max_parallel: int) -> dict[str, Any]:
    """A fanout whose two children make the very same job call (``jobs.sleep`` 2 s)."""
    child = [{"tool_calls": [{"tool": "jobs.sleep", "args": {"seconds": 2}}]}, {"final": "slept"}]
    return {
        "name": "sleepers",
        "version": "1.0.0",
        "coordination": "fanout",
        "coordination_params": {"max_parallel": max_parallel},
        "tools": [],
        "model": scripted([{"plan": ["a", "b"]}, {"final": "both slept"}]),
        "roles": {"worker": {"tools": ["jobs.sleep"], "model": scripted(child)}},
    }


def refolds(records: list[EventRecord], session_id: str) -> None:
    """The stored log folds whole (the SSE records turned back into envelopes)."""
    envelopes = [
        make(
            session_id,
            r.index,
            r.ts,
            f"id-{r.index}",
            msgspec.json.decode(msgspec.json.encode(r.event), type=Event),
        )
        for r in records
    ]
    fold(envelopes, session_id)


@pytest.mark.parametrize("max_parallel", [1, 2], ids=["one-after-the-other", "side-by-side"])
def test_two_children_making_the_same_job_call_each_get_their_own_job(
    mesh: Mesh, max_parallel: int
) -> None:
    session_id = start(mesh.url, "sleep twice", sleepers(max_parallel))
    ended = wait_ended(mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "both slept"
    records = log_of(mesh.url, session_id)
    refolds(records, session_id)
    started = [r.event for r in records if r.kind == "AsyncJobStarted"]
    finished = [r.event for r in records if r.kind == "AsyncJobFinished"]
    # One job per child, each finished for its own agent with its own result.
    assert sorted(e["agent"] for e in started) == ["root/0", "root/1"], started
    assert sorted(e["agent"] for e in finished) == ["root/0", "root/1"], finished
    assert all(e["ok"] and e["result"] == "slept 2 s" for e in finished), finished
    # No re-dispatch loop: each child is dispatched once for its job call and once after it.
    dispatched = Counter(
        r.event["agent"]
        for r in records
        if r.kind == "AgentLifecycle" and r.event["phase"] == "dispatched"
    )
    assert dispatched["root/0"] == dispatched["root/1"] == 2, dispatched
    assert kinds(records).count("AgentResuming") == 0
    assert len(records) < 80, Counter(kinds(records))


def deployer(tool: str) -> dict[str, Any]:
    return {
        "name": "deployer",
        "version": "1.0.0",
        "coordination": "solo",
        "workspace": "shared",  # one deploys.log for the whole test
        "tools": [tool],
        "model": scripted(
            [
                {"tool_calls": [{"tool": tool, "args": {"version": "v2", "settle": 30}}]},
                {"final": "deploy finished"},
            ]
        ),
    }


def deploys(mesh: Mesh) -> list[str]:
    record = mesh.daemon.workspace / "deploys.log"
    return record.read_text().splitlines() if record.exists() else []


def poll(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"never {what}")


def test_a_graceful_restart_waits_for_a_side_effecting_job_and_resumes_by_itself(
    mesh: Mesh,
) -> None:
    definition = deployer("probe.deploy")
    definition["model"]["turns"][0]["tool_calls"][0]["args"]["settle"] = 3
    session_id = start(mesh.url, "deploy v2 across an upgrade", definition)
    poll(lambda: deploys(mesh), "ran the deploy")
    # SIGTERM while the job settles: the drain waits for it (the grace period is 10 s) instead
    # of cutting it off into an unknown outcome, then marks the session suspended.
    mesh.daemon.stop()
    mesh.daemon.start()
    ended = wait_ended(mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "deploy finished"
    assert len(deploys(mesh)) == 1, deploys(mesh)
    with SyncClient(mesh.url) as client:
        assert session_id not in {r.session_id for r in client.list_recoverable()}
    records = log_of(mesh.url, session_id)
    names = kinds(records)
    assert names.index("AsyncJobFinished") < names.index("SessionSuspended"), names
    finished = records[names.index("AsyncJobFinished")].event
    assert finished["ok"] is True and not finished.get("unknown"), finished
    assert [r.event["path"] for r in records if r.kind == "SessionRecovered"] == ["auto"]
    refolds(records, session_id)


@pytest.mark.parametrize("tool", ["probe.deploy", "probe.deploy_held"])
def test_a_side_effecting_job_in_flight_at_a_crash_is_never_run_again(
    mesh: Mesh, tool: str
) -> None:
    session_id = start(mesh.url, "deploy v2", deployer(tool))
    wait_until(
        mesh.url, session_id, lambda v: v["agents"][0]["phase"] == "waiting", "waited for its job"
    )
    poll(lambda: deploys(mesh), "ran the deploy")
    running = view(mesh.url, session_id)
    assert running["side_effects"] == 1, running
    (outcome,) = running["unknown_outcomes"]  # in flight: its outcome is not known yet
    assert (outcome["tool"], outcome["job"]) == (tool, True)

    mesh.daemon.kill()
    mesh.daemon.start()
    with SyncClient(mesh.url) as client:

        def listed() -> Any:
            rows = [r for r in client.list_recoverable() if r.session_id == session_id]
            return rows[0] if rows else None

        # Not auto-resumed: a side effect is logged, and its outcome is unknown.
        stranded = poll(listed, "listed the session as recoverable")
        assert stranded.side_effects == 1
        assert [(u.tool, u.agent, u.job) for u in stranded.unknown_outcomes] == [
            (tool, "root", True)
        ]
        assert len(deploys(mesh)) == 1
        client.resume(session_id)
    ended = wait_ended(mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "deploy finished"
    assert len(deploys(mesh)) == 1, deploys(mesh)  # the operator's resume did not run it again
    records = log_of(mesh.url, session_id)
    names = kinds(records)
    assert names.count("AsyncJobStarted") == names.count("AsyncJobFinished") == 1, names
    finished = records[names.index("AsyncJobFinished")].event
    assert finished["unknown"] is True and finished["ok"] is False
    assert "not run again" in finished["result"]
    # The agent was told: the job's error is in its conversation, and it went on to its answer.
    assert names.index("SessionRecovered") < names.index("AsyncJobFinished")


def test_a_hold_stops_the_sibling_agents_before_the_session_waits(mesh: Mesh) -> None:
    # Both children launch (a slow side effect on their worker, ``on_unknown = "hold"``).
    launch = {"tool": "probe.launch", "args": {"version": "{task}", "settle": "30{index}"}}
    definition = {
        "name": "launchers",
        "version": "1.0.0",
        "coordination": "fanout",
        "workspace": "shared",  # one deploys.log for the whole test
        "coordination_params": {"max_parallel": 2},
        "tools": [],
        "model": scripted([{"plan": ["first", "second"]}, {"final": "both launched"}]),
        "roles": {
            "worker": {
                "tools": ["probe.launch"],
                "model": scripted([{"tool_calls": [launch]}, {"final": "launched"}]),
            }
        },
    }
    session_id = start(mesh.url, "launch twice", definition)
    lines = poll(lambda: len(deploys(mesh)) == 2 and deploys(mesh), "launched both")
    runs = {json.loads(line)["agent"]: json.loads(line)["pid"] for line in lines}
    assert runs["root/0"] != runs["root/1"], runs  # one child on each worker
    # Kill the first child's worker in the middle of its effect: its re-dispatch finds the
    # intent without a result, and the tool holds the session for an operator.
    next(w for w in mesh.workers if w.pid == runs["root/0"]).kill()
    with SyncClient(mesh.url) as client:
        stranded = poll(
            lambda: next(
                (r for r in client.list_recoverable() if r.session_id == session_id), None
            ),
            "held the session",
        )
        assert "held for an operator" in stranded.reason, stranded

        def idle() -> bool:
            # The sibling's dispatch was cancelled on its worker: it runs nothing any more
            # (its own effect would take minutes to settle).
            workers = [w for w in client.list_workers() if w.alive]
            return bool(workers) and all(not w.agents for w in workers)

        poll(idle, "stopped the sibling on its worker")
    held = view(mesh.url, session_id)
    phases = {a["ref"]: a["phase"] for a in held["agents"]}
    assert phases["root/1"] != "completed", phases
    assert len(deploys(mesh)) == 2  # nothing ran again
