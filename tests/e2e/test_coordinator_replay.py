"""Coordinator loops replayed on real processes: a daemon SIGKILLed (or a session resumed by an
operator) at a later round of a loop continues it exactly where the uninterrupted run would be.

Each test runs a real nats-server, an ``apomesh serve`` process and ``apomesh worker`` processes
(the ``mesh`` fixture). ``refine`` and ``fanout`` are the built-in kinds; ``vote`` is a third-party
kind (``tests/e2e/plugins/apomesh-vote``) written from docs/plugins.md alone: it asks the root
several times between checkpoints and ends each ballot early at a majority.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.nats_connect import connect
from apomesh.core.envelope import Envelope
from apomesh.sdk.client import SessionView, SyncClient
from apomesh.testing import Mesh, WorkerProcess, install_plugin_package

VOTE_PROJECT = Path(__file__).resolve().parent / "plugins" / "apomesh-vote"
TERMINAL = ("completed", "failed", "cancelled")


@pytest.fixture(scope="module", autouse=True)
def vote_plugin() -> str:
    return install_plugin_package(VOTE_PROJECT)


def wait_until(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "it") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited in vain for {what}")
        time.sleep(0.05)


def wait_ended(client: SyncClient, session_id: str, timeout: float = 90.0) -> SessionView:
    return wait_until(
        lambda: (v := client.get_session(session_id)).status in TERMINAL and v,
        timeout,
        f"session {session_id} to end",
    )


def read_log(mesh: Mesh, session_id: str) -> list[Envelope]:
    async def read() -> list[Envelope]:
        nc = await connect([mesh.nats_url])
        try:
            return await JetStreamLog(nc).read(session_id)
        finally:
            await nc.close()

    return asyncio.run(read())


def root_answers(envelopes: list[Envelope]) -> list[tuple[str, str | None]]:
    """(phase, purpose) of every answer the root gave, in log order."""
    return [
        (e.event.phase, e.event.purpose)
        for e in envelopes
        if type(e.event).__name__ == "AgentLifecycle"
        and e.event.agent == "root"
        and e.event.phase in ("planned", "completed")
    ]


def scripted(turns: list[dict[str, Any]]) -> dict[str, Any]:
    return {"provider": "scripted", "turns": turns}


def note_worker(mesh: Mesh, name: str) -> WorkerProcess:
    """One more worker, the only one with the ``vote.note`` tool."""
    worker = WorkerProcess(
        [mesh.nats_url], mesh.daemon.workspace, name, env={**mesh.env, "APOMESH_VOTE_NOTE": "1"}
    )
    worker.start()
    mesh.workers.append(worker)
    return worker


def restart_daemon(mesh: Mesh, **env: str) -> None:
    mesh.daemon.kill()  # SIGKILL
    mesh.daemon.env.update(env)
    mesh.daemon.start()


# --- refine: a restart at a later round ---------------------------------------------------------


def refine_definition() -> dict[str, Any]:
    return {
        "name": "refiner",
        "version": "1.0.0",
        "coordination": "refine",
        "coordination_params": {"max_iterations": 3},
        # The root alone needs `vote.note`: it runs only on the worker that has it.
        "tools": ["vote.note"],
        "model": scripted(
            [
                {"plan": ["P1-a"]},
                {"plan": ["P2-a"]},
                {"plan": ["P3-a"]},
                {"final": "FINAL ANSWER"},
            ]
        ),
        # Slow enough for the daemon to see a killed worker gone before a batch ends.
        "roles": {
            "worker": {"tools": [], "model": scripted([{"delay": 3, "final": "did {task}"}])}
        },
    }


def test_refine_killed_at_a_later_round_completes_like_the_uninterrupted_run(
    bare_mesh: Mesh,
) -> None:
    bare_mesh.daemon.env["APOMESH_VOTE_NOTE"] = "1"
    bare_mesh.start(2)
    root_worker = note_worker(bare_mesh, "root-worker")
    bare_mesh.wait_workers(3)
    client = SyncClient(bare_mesh.url)
    session_id = client.start_session("refine it", definition=refine_definition())

    def checkpoints() -> list[str]:
        return [
            e.event.position
            for e in read_log(bare_mesh, session_id)
            if type(e.event).__name__ == "CoordinatorCheckpoint"
        ]

    # The root answered the first critique (iteration 2 is planned): take its worker away, so
    # the loop stops right after it checkpoints iteration 2's results, the root not yet asked.
    wait_until(lambda: "planned@2" in checkpoints(), what="iteration 2 planned")
    root_worker.kill()
    wait_until(
        lambda: not any(w.name == "root-worker" and w.alive for w in client.list_workers()),
        what="the root's worker declared lost",
    )
    assert "executed@2" not in checkpoints()
    wait_until(lambda: "executed@2" in checkpoints(), what="iteration 2 executed")
    restart_daemon(bare_mesh)
    note_worker(bare_mesh, "root-worker-2")

    view = wait_ended(client, session_id)
    assert view.status == "completed", view.reason
    assert view.output == "FINAL ANSWER"
    assert view.recoveries >= 1
    children = sorted((a.batch, a.task) for a in view.agents if a.parent == "root")
    assert children == [("iter-1", "P1-a"), ("iter-2", "P2-a"), ("iter-3", "P3-a")]
    assert root_answers(read_log(bare_mesh, session_id)) == [
        ("planned", "plan"),
        ("planned", "critique"),
        ("planned", "critique"),
        ("completed", "synthesize"),
    ]


# --- operator resume: a failed child is not run again -------------------------------------------


def test_operator_resume_does_not_run_a_failed_childs_effect_again(mesh: Mesh) -> None:
    definition = {
        "name": "charger",
        "version": "1.0.0",
        "coordination": "refine",
        "coordination_params": {"max_iterations": 1},
        "model": scripted([{"plan": ["charge-A", "approve-B"]}, {"final": "synthesized"}]),
        "roles": {
            "worker": {
                "tools": ["fs.append", "ask_human"],
                # One step each: append its line, ask a human; once answered, the child is out
                # of budget and fails (refine goes on with failed sub-tasks).
                "budget": {"max_steps": 1},
                "model": scripted(
                    [
                        {
                            "tool_calls": [
                                {
                                    "tool": "fs.append",
                                    "args": {"path": "ledger.txt", "line": "{task}"},
                                },
                                {"tool": "ask_human", "args": {"question": "go on after {task}?"}},
                            ]
                        }
                    ]
                ),
            }
        },
    }
    client = SyncClient(mesh.url)
    session_id = client.start_session("charge once", definition=definition)
    pauses = wait_until(
        lambda: len(p := client.get_session(session_id).hitl_pending) == 2 and p,
        what="both pauses",
    )
    tasks = {a.ref: a.task for a in client.get_session(session_id).agents}
    charge = next(p for p in pauses if tasks[p.agent] == "charge-A")
    approve = next(p for p in pauses if tasks[p.agent] == "approve-B")
    client.answer_hitl(session_id, charge.pause_id, "go")
    wait_until(
        lambda: any(
            a.ref == charge.agent and a.phase == "failed"
            for a in client.get_session(session_id).agents
        ),
        what="the charge to fail",
    )
    ledger = mesh.daemon.workspace / session_id / "ledger.txt"
    assert sorted(ledger.read_text().splitlines()) == ["approve-B", "charge-A"]
    restart_daemon(mesh)  # the batch is not joined yet: approve-B still waits for its answer

    recoverable = wait_until(
        lambda: [r for r in client.list_recoverable() if r.session_id == session_id],
        what="the session on the recoverable list",
    )
    assert recoverable[0].unknown_outcomes == []
    client.resume(session_id, confirm=True)
    wait_until(lambda: client.get_session(session_id).recoveries >= 1, what="the resume")
    client.answer_hitl(session_id, approve.pause_id, "go")
    view = wait_ended(client, session_id)
    assert view.status == "completed", view.reason
    assert view.output == "synthesized"
    lines = ledger.read_text().splitlines()
    assert sorted(lines) == ["approve-B", "charge-A"], lines
    children = [a for a in view.agents if a.parent == "root"]
    assert sorted(a.ref for a in children) == sorted([charge.agent, approve.agent])


# --- HITL: the pause the operator saw survives an auto-resume -----------------------------------


def test_a_childs_pause_is_answered_by_the_id_the_operator_saw_after_a_daemon_kill(
    mesh: Mesh,
) -> None:
    definition = {
        "name": "approver",
        "version": "1.0.0",
        "coordination": "fanout",
        "model": scripted([{"plan": ["approve budget"]}, {"final": "synthesized"}]),
        "roles": {
            "worker": {
                "tools": ["ask_human"],
                "model": scripted(
                    [
                        {"tool_calls": [{"tool": "ask_human", "args": {"question": "{task}?"}}]},
                        {"final": "answered"},
                    ]
                ),
            }
        },
    }
    client = SyncClient(mesh.url)
    session_id = client.start_session("approve", definition=definition)
    seen = wait_until(lambda: client.get_session(session_id).hitl_pending, what="the pause")
    restart_daemon(mesh)  # no side effects: the boot scan auto-resumes it

    wait_until(lambda: client.get_session(session_id).recoveries >= 1, what="the auto-resume")
    client.answer_hitl(session_id, seen[0].pause_id, "yes, approved")
    view = wait_ended(client, session_id)
    assert view.status == "completed", view.reason
    assert view.output == "synthesized"
    envelopes = read_log(mesh, session_id)
    paused = [e.event.pause_id for e in envelopes if type(e.event).__name__ == "HitlPaused"]
    assert paused == [seen[0].pause_id]
    child = next(a for a in view.agents if a.parent == "root" and a.phase == "completed")
    assert child.ref == seen[0].agent


# --- a fan-in over 1 MiB ----------------------------------------------------------------------


def test_a_fan_in_over_one_mib_completes(mesh: Mesh) -> None:
    tasks = [f"{i}" + "x" * 50_000 for i in range(4)]
    definition = {
        "name": "big-fan",
        "version": "1.0.0",
        "coordination": "fanout",
        "model": scripted([{"plan": tasks}, {"final": "joined"}]),
        # Each child answers its task six times over: 4 x 300 kB of results to join.
        "roles": {"worker": {"model": scripted([{"final": "{task}" * 6}])}},
    }
    client = SyncClient(mesh.url)
    session_id = client.start_session("fan in", definition=definition)
    view = wait_ended(client, session_id)
    assert view.status == "completed", view.reason
    assert view.output == "joined"
    outputs = [a.output or "" for a in view.agents if a.parent == "root"]
    assert sum(len(o) for o in outputs) > 1024 * 1024


# --- a third-party kind: several asks, a batch ended at its majority ----------------------------


def vote_definition(kind: str = "vote", voter_turn: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": "voting",
        "version": "1.0.0",
        "coordination": kind,
        "coordination_params": {"voters": 5},
        "model": scripted(
            [
                {"delay": 0.6, "plan": ["red", "blue"]},
                {"delay": 0.6, "final": "red"},
                {"delay": 0.6, "final": "red it is"},
            ]
        ),
        "roles": {"voter": {"model": scripted([voter_turn or {"delay": 0.3, "final": "red"}])}},
    }


def test_vote_ends_its_ballot_at_the_majority_and_survives_a_kill_at_every_ask(
    mesh: Mesh,
) -> None:
    client = SyncClient(mesh.url)
    session_id = client.start_session("pick a colour", definition=vote_definition())
    for ask in (1, 2, 3):
        # The root is working on its ask-th answer: SIGKILL the daemon there.
        wait_until(
            lambda ask=ask: (
                len(root_answers(read_log(mesh, session_id))) == ask - 1
                and client.get_session(session_id).agents[0].phase in ("dispatched", "running")
            ),
            what=f"ask {ask}",
        )
        restart_daemon(mesh)
    view = wait_ended(client, session_id)
    assert view.status == "completed", view.reason
    assert view.output == "red it is"
    assert root_answers(read_log(mesh, session_id)) == [
        ("planned", "plan"),
        ("completed", "critique"),
        ("completed", "synthesize"),
    ]
    voters = [a for a in view.agents if a.parent == "root"]
    done = [a for a in voters if a.phase == "completed"]
    assert len({a.task for a in done}) >= 3
    assert len({a.task for a in done}) < 5  # the majority ended the ballot early


def test_a_replayed_batch_with_other_tasks_fails_with_a_nondeterminism_error(
    bare_mesh: Mesh,
) -> None:
    bare_mesh.daemon.env["APOMESH_VOTE_SALT"] = "one"
    bare_mesh.start(2)
    client = SyncClient(bare_mesh.url)
    definition = vote_definition("vote-salted")
    definition["roles"]["voter"] = {
        "tools": ["ask_human"],
        "model": scripted(
            [{"tool_calls": [{"tool": "ask_human", "args": {"question": "vote {index}?"}}]}]
        ),
    }
    session_id = client.start_session("pick a colour", definition=definition)
    wait_until(lambda: client.get_session(session_id).hitl_pending, what="a voter's pause")
    restart_daemon(bare_mesh, APOMESH_VOTE_SALT="two")
    view = wait_ended(client, session_id)
    assert view.status == "failed"
    assert "nondeterminism" in (view.reason or "").lower() or "differs from the logged" in (
        view.reason or ""
    ), view.reason
