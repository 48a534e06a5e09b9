"""Recovery an operator relies on, on real processes (``mesh``: a nats-server, an ``apomesh serve``
process, worker processes): a graceful restart (SIGTERM) resumes every session by itself while a
crash (SIGKILL) lists those with side effects; a ``hold`` holds every new unknown outcome, even
after an earlier operator resume; bulk resume from the CLI and the API; and plugin pins that keep a
session's agents off a worker whose plugin versions differ.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from tests.e2e.chaos_kit import appender, check_session, fanout_appender, shape_of, stored_session
from tests.e2e.plane_support import (
    PROBE_PROJECT,
    build_at_version,
    install_test_plugins,
    probe_records,
    run_cli,
    session_view,
)
from tests.e2e.test_recovery import write_log

from apomesh.core.views import RecoverableView
from apomesh.plugins.manager import PluginHost
from apomesh.sdk.client import Client, EventRecord
from apomesh.testing import Mesh, WorkerProcess

JSON = {"Content-Type": "application/json"}
PROBE = "apomesh-pinprobe"


async def finished(client: Client, session_id: str, timeout: float = 90) -> list[EventRecord]:
    with anyio.fail_after(timeout):
        return [record async for record in client.events(session_id)]


async def wait_for(predicate: Any, what: str, timeout: float = 60.0) -> Any:
    with anyio.fail_after(timeout):
        while True:
            value = await predicate()
            if value:
                return value
            await anyio.sleep(0.1)


# --- a graceful restart resumes by itself; a crash lists the sessions with side effects ----------


@pytest.mark.anyio
@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
async def test_a_graceful_restart_resumes_every_session_by_itself_and_a_crash_lists_them(
    mesh: Mesh, stop: str
) -> None:
    goals = [f"drain-{stop}-{n}-{uuid.uuid4().hex[:6]}" for n in range(3)]
    async with Client(mesh.url) as client:
        definitions = [appender(8, delay=0.4), appender(8, delay=0.4), fanout_appender(2, 6, 0.4)]
        ids = [
            await client.start_session(goal, definition=definition)
            for goal, definition in zip(goals, definitions, strict=True)
        ]

        async def all_have_effects() -> bool:
            views = [await client.get_session(s) for s in ids]
            return all(v.side_effects >= 2 and not v.terminal for v in views)

        await wait_for(all_have_effects, "every session made a side effect")
    await anyio.to_thread.run_sync(mesh.daemon.stop if stop == "sigterm" else mesh.daemon.kill)
    await anyio.to_thread.run_sync(mesh.daemon.start)
    async with Client(mesh.url) as client:
        listed = {r.session_id: r for r in await client.list_recoverable()}
        if stop == "sigkill":
            # A crash: side effects logged, so each waits for an operator, as the design says.
            assert set(listed) == set(ids)
            assert {r.category for r in listed.values()} == {"side_effects"}
            for session_id in ids:
                await client.resume(session_id)
        else:
            assert listed == {}
        for session_id in ids:
            records = await finished(client, session_id)
            check = check_session(
                records, await client.verify_session(session_id), mesh.daemon.workspace
            )
            assert check.ok, check.problems
            kinds = [r.kind for r in records]
            resumed = [r.event["reason"] for r in records if r.kind == "AgentResuming"]
            if stop == "sigterm":
                # Drained at a node boundary: suspended with nothing in flight, then resumed under
                # the same ref, its effects served from the journal (each line once, no unknown).
                assert "SessionSuspended" in kinds and "OperatorAction" not in kinds
                assert [r.event["path"] for r in records if r.kind == "SessionRecovered"] == [
                    "auto"
                ]
                assert resumed and set(resumed) == {"daemon restart"}
                assert check.unknown_outcomes == 0
            else:
                assert "SessionSuspended" not in kinds
                assert resumed and set(resumed) == {"operator resume"}
            # Every agent kept its ref: none was born again after the restart.
            born = [r.event["agent"] for r in records if r.event.get("phase") == "born"]
            assert born == (["root"] if session_id != ids[2] else ["root", "root/0", "root/1"])


# --- hold holds every new unknown outcome, after an earlier operator resume too -------------------


@pytest.fixture(scope="module")
def plugin_packages() -> None:
    install_test_plugins()


def charging_agent(*ids: str) -> dict[str, Any]:
    """A solo agent making one ``probe.charge`` per turn (``on_unknown = "hold"``); every call
    hangs, so a test can kill the worker inside it."""
    turns: list[dict[str, Any]] = [
        {"tool_calls": [{"tool": "probe.charge", "args": {"id": i, "hang": True}}]} for i in ids
    ]
    return {
        "name": "charger",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": ["probe.charge"],
        "model": {"provider": "scripted", "turns": [*turns, {"final": "charged"}]},
    }


def kill_worker_running(mesh: Mesh, session_id: str, ref: str = "root") -> None:
    names = {w["id"]: w["name"] for w in httpx.get(f"{mesh.url}/v1/workers").json()["workers"]}
    agents = {a["ref"]: a for a in session_view(mesh.url, session_id)["agents"]}
    name = names[agents[ref]["worker"]]
    next(w for w in mesh.workers if w.name == name).kill()


async def held(client: Client, session_id: str) -> RecoverableView:
    async def listed() -> RecoverableView | None:
        entries = {r.session_id: r for r in await client.list_recoverable()}
        if session_id not in entries:
            view = await client.get_session(session_id)
            assert not view.terminal, f"ended {view.status} instead of being held: {view.reason}"
        return entries.get(session_id)

    entry: RecoverableView = await wait_for(listed, "the session is held for an operator")
    return entry


@pytest.mark.anyio
async def test_hold_holds_a_new_unknown_outcome_after_an_earlier_operator_resume(
    mesh: Mesh, plugin_packages: None
) -> None:
    async with Client(mesh.url) as client:
        session_id = await client.start_session("charge twice", definition=charging_agent("a", "b"))
        for n, charge in enumerate(("a", "b"), start=1):

            async def intent_logged(count: int = n) -> bool:
                return (await client.get_session(session_id)).side_effects >= count

            await wait_for(intent_logged, f"the intent of charge {charge} is on the log")
            mesh.worker()  # somewhere for the agent to go once its worker is gone
            await anyio.to_thread.run_sync(kill_worker_running, mesh, session_id)
            entry = await held(client, session_id)
            # Held, not failed: the operator sees exactly this call's unknown outcome.
            assert entry.category == "held"
            assert [u.args["id"] for u in entry.unknown_outcomes][-1] == charge
            view = await client.get_session(session_id)
            assert not view.terminal
            await client.resume(session_id)
        records = await finished(client, session_id)
    assert records[-1].event["status"] == "completed"
    resumes = [r.event for r in records if r.kind == "OperatorAction"]
    assert [len(r["detail"]["acknowledged"]) for r in resumes] == [1, 2]
    recorded = [r.event for r in records if r.kind == "ToolCallRecorded"]
    assert [r["outcome"] for r in recorded] == ["unknown", "unknown"]
    assert all("held for an operator" in r["result"] for r in recorded)
    assert not (
        mesh.daemon.workspace / session_id / "charges.txt"
    ).exists()  # neither charge ever ran


# --- bulk resume, from the CLI and the API; two resumes of one session ----------------------------


async def stranded_sessions(mesh: Mesh, goals: list[str]) -> list[str]:
    """Sessions a crashed daemon left with a side effect logged: on the recoverable list once the
    daemon is started again (SIGKILL then start, as after a crash)."""
    logs = []
    for goal in goals:
        session_id = uuid.uuid4().hex
        args = {"path": f"chaos/{goal}.txt", "line": f"{goal} line 0"}
        done = mesh.daemon.workspace / session_id / args["path"]  # the effect the log records
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(args["line"] + "\n")
        logs.append(
            stored_session(
                session_id,
                shape_of(appender(2)),
                goal=goal,
                events=5,
                side_effect=("fs.append", args, False),
            )
        )
    await write_log(mesh.nats_url, *logs)
    await anyio.to_thread.run_sync(mesh.daemon.kill)
    await anyio.to_thread.run_sync(mesh.daemon.start)
    return [envs[0].session_id for envs in logs]


@pytest.mark.anyio
async def test_bulk_resume_from_the_cli_and_the_api_and_two_resumes_of_one_session(
    mesh: Mesh,
) -> None:
    cli_goals = [f"bulk-cli {n}" for n in range(3)]
    api_goals = [f"bulk-api {n}" for n in range(3)]
    cli_ids = await stranded_sessions(mesh, cli_goals)
    api_ids = await stranded_sessions(mesh, [*api_goals, "race"])
    race_id = api_ids.pop()
    async with Client(mesh.url) as client:
        listed = {r.session_id for r in await client.list_recoverable()}
        assert listed == {*cli_ids, *api_ids, race_id}

        # The CLI shows what it would resume and, without a terminal to ask, refuses unless --yes.
        args = ("recover", "resume", "--all", "--filter", "goal=bulk-cli")
        refused = run_cli(mesh.url, *args, check=False)
        assert refused.returncode == 2 and "--yes" in refused.stderr
        assert all(s in refused.stdout for s in cli_ids)
        assert {r.session_id for r in await client.list_recoverable()} == listed
        resumed = run_cli(mesh.url, *args, "--yes", "--filter", "category=side_effects")
        assert all(f"resumed {s}" in resumed.stdout for s in cli_ids)

        # The API: without confirm, the sessions it would resume; with it, one outcome each.
        body = {"filter": {"goal": "BULK-API"}}
        async with httpx.AsyncClient(base_url=mesh.url, headers=JSON) as http:
            ask = await http.post("/v1/recoverable/resume", json=body)
            assert ask.status_code == 409 and ask.json()["error"] == "confirm_required"
            assert {s["session_id"] for s in ask.json()["sessions"]} == set(api_ids)
            done = await http.post("/v1/recoverable/resume", json={**body, "confirm": True})
            assert done.status_code == 200
            outcomes = {s["session_id"]: s["outcome"] for s in done.json()["sessions"]}
            assert outcomes == dict.fromkeys(api_ids, "resumed")

            # Two operators resume one session at the same moment: one wins, the other is 409.
            path = f"/v1/sessions/{race_id}/resume"
            answers = []

            async def resume() -> None:
                answers.append(await http.post(path, json={"confirm": True}))

            async with anyio.create_task_group() as both:
                both.start_soon(resume)
                both.start_soon(resume)
            assert sorted(a.status_code for a in answers) == [202, 409]
            assert {a.json().get("error") for a in answers if a.status_code == 409} == {
                "apomesh_error"
            }
        assert await client.list_recoverable() == []
        for session_id in [*cli_ids, *api_ids, race_id]:
            records = await finished(client, session_id)
            check = check_session(
                records, await client.verify_session(session_id), mesh.daemon.workspace
            )
            assert check.ok, check.problems
            assert [r.event["action"] for r in records if r.kind == "OperatorAction"] == ["resume"]


# --- pins reach the workers ------------------------------------------------------------------------


def workers_by_name(mesh: Mesh) -> dict[str, dict[str, Any]]:
    rows = httpx.get(f"{mesh.url}/v1/workers").json()["workers"]
    return {w["name"]: w for w in rows if w["alive"]}


@pytest.mark.anyio
async def test_a_worker_with_another_version_of_a_pinned_plugin_never_gets_the_sessions_agents(
    bare_mesh: Mesh, plugin_packages: None, tmp_path: Path
) -> None:
    installed = PluginHost(allow=[PROBE], environ={}).installed_versions()[PROBE]
    site = await anyio.to_thread.run_sync(build_at_version, PROBE_PROJECT, "9.9.9", tmp_path)
    await anyio.to_thread.run_sync(bare_mesh.daemon.start)  # no worker with the installed version

    async def only(names: set[str]) -> bool:
        return set(await anyio.to_thread.run_sync(workers_by_name, bare_mesh)) == names

    await wait_for(lambda: only(set()), "the matching workers are gone")
    other = WorkerProcess(  # this plugin at another version first on its path
        [bare_mesh.nats_url], bare_mesh.daemon.workspace, "other", env={"PYTHONPATH": str(site)}
    )
    other.start()
    bare_mesh.workers.append(other)
    await wait_for(lambda: only({"other"}), "the other worker registered")
    assert workers_by_name(bare_mesh)["other"]["plugins"][PROBE] == "9.9.9"

    record = tmp_path / "calls.jsonl"
    definition = {
        "name": "pinned-reader",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": ["fs.list"],
        "model": {
            "provider": "probe",
            "record": str(record),
            "turns": [
                {"tool_calls": [{"tool": "fs.list", "args": {"path": "."}}]},
                {"final": "read"},
            ],
        },
    }
    async with Client(bare_mesh.url) as client:
        session_id = await client.start_session("pinned", definition=definition)
        waiting = f"session {session_id} agent root waits for a worker whose plugins match its pins"

        async def says_it_waits() -> bool:
            return waiting in bare_mesh.daemon.output_tail(200_000)

        # No capable worker: the session waits, visibly, and is not failed.
        await wait_for(says_it_waits, "the daemon says the session waits for a worker")
        assert (
            f"{PROBE}=={installed}: the worker has version 9.9.9" in bare_mesh.daemon.output_tail()
        )
        view = await client.get_session(session_id)
        assert view.status == "running" and {a.ref: a.phase for a in view.agents} == {
            "root": "born"
        }
        good = bare_mesh.worker("good")
        records = await finished(client, session_id)
    assert records[-1].event["status"] == "completed"
    ids = {w["name"]: w["id"] for w in httpx.get(f"{bare_mesh.url}/v1/workers").json()["workers"]}
    dispatched = {r.event["worker"] for r in records if r.event.get("phase") == "dispatched"}
    assert dispatched == {ids["good"]}
    assert {call["pid"] for call in probe_records(record)} == {good.pid}


@pytest.mark.anyio
async def test_a_session_waiting_for_a_worker_is_suspended_by_a_graceful_restart(
    bare_mesh: Mesh,
) -> None:
    # No worker yet; stranded_sessions starts the daemon.
    (session_id,) = await stranded_sessions(bare_mesh, ["waits for a worker"])
    async with Client(bare_mesh.url) as client:
        await client.resume(session_id)  # live now, its agent waiting for a worker
        assert await client.list_recoverable() == []
    await anyio.to_thread.run_sync(bare_mesh.daemon.stop)
    await anyio.to_thread.run_sync(bare_mesh.daemon.start)
    async with Client(bare_mesh.url) as client:
        assert await client.list_recoverable() == []  # resumed by itself, not stranded
        bare_mesh.worker()
        records = await finished(client, session_id)
        check = check_session(
            records, await client.verify_session(session_id), bare_mesh.daemon.workspace
        )
    assert check.ok, check.problems
    kinds = [r.kind for r in records]
    assert kinds.count("SessionSuspended") == 1 and kinds.count("OperatorAction") == 1
    assert [r.event["path"] for r in records if r.kind == "SessionRecovered"] == [
        "operator",
        "auto",
    ]
