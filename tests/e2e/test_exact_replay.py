"""Exact replay on a model that never repeats itself: a model turn is recorded before it is acted
on, and a re-dispatched or resumed agent replays it instead of asking the model again.

Real processes throughout: a nats-server, an ``apomesh serve`` process, ``apomesh worker``
processes answered by the fresh-model server (``tests/fakes/fresh_model.py``) through the
``openai`` provider and a configured credential. The workers stop themselves at an exact point of
an agent's step (``tests/e2e/kill_points/sitecustomize.py``: before the intent, between the intent
and the effect, between the effect and the report of its result, between the last report and
``Done``) and are then SIGKILLed, or left frozen past the heartbeat threshold. Each session is
audited against the model server's record (``tests/e2e/chaos_audit.py``): every effect at most
once, no two answers for one step both landed, and the output is the answer the model gave — the
one recorded before the kill, the model never asked again for a recorded step.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from tests.e2e.chaos_audit import audit_session
from tests.e2e.test_model_credentials import credentials_config, restart_daemon_with
from tests.fakes.fresh_model import PLAN_MARKER, FreshModelServer

from apomesh.sdk.client import EventRecord, SyncClient
from apomesh.testing import Mesh, WorkerProcess

TIMEOUT = 60.0
KILL_POINTS = Path(__file__).parent / "kill_points"


# --- the system ----------------------------------------------------------------------------------


class ReplayMesh:
    """A mesh whose workers reach the fresh-model server and carry the kill points."""

    def __init__(self, mesh: Mesh, server: FreshModelServer) -> None:
        self.mesh = mesh
        self.server = server
        self.gates = mesh.base / "gates"
        self.gates.mkdir()
        self.config = credentials_config(mesh.base / "fresh.toml", fresh=server.base_url)
        restart_daemon_with(mesh, self.config)
        self.worker()
        self.worker()
        mesh.wait_workers(2)

    @property
    def url(self) -> str:
        return self.mesh.url

    def worker(self) -> WorkerProcess:
        env = {"MODEL_KEY": "sk-fresh", **kill_points_env(self.gates)}
        return self.mesh.worker(f"r{len(self.mesh.workers)}", env=env, config=self.config)

    def arm(self, point: str) -> None:
        (self.gates / f"arm-{point}").touch()

    def wait_hit(self, point: str) -> WorkerProcess:
        """The worker frozen at ``point`` (it stopped itself there)."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            for hit in self.gates.glob(f"hit-{point}-*"):
                pid = int(hit.name.rpartition("-")[2])
                hit.unlink()
                (worker,) = [w for w in self.mesh.workers if w.proc and w.proc.pid == pid]
                return worker
            time.sleep(0.02)
        raise AssertionError(f"no worker reached the kill point {point!r}")

    def wait_daemon_hit(self, point: str) -> int:
        """The pid of the daemon frozen at ``point`` (a daemon's kill point, see
        ``kill_points``), once it stopped itself there."""
        deadline = time.monotonic() + TIMEOUT
        while not (hits := list(self.gates.glob(f"hit-{point}-*"))):
            assert time.monotonic() < deadline, f"no daemon reached the kill point {point!r}"
            time.sleep(0.02)
        (hit,) = hits
        return int(hit.name.rpartition("-")[2])

    def kill_at(self, point: str) -> None:
        """Arm ``point``, SIGKILL the worker that reaches it, start a fresh one in its place."""
        self.arm(point)
        self.wait_hit(point).kill()
        self.worker()


def kill_points_env(gates: Path) -> dict[str, str]:
    """The environment that makes a worker or daemon process carry the kill points."""
    return {
        "KILL_POINTS_DIR": str(gates),
        "PYTHONPATH": os.pathsep.join(
            [str(KILL_POINTS), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }


def fresh(name: str) -> dict[str, Any]:
    """The ``[model]`` table for the fresh-model server under ``name`` (``fresh:...``)."""
    return {"provider": "openai", "model": name, "credential": "fresh", "timeout": 10}


def solo_appender(appends: int) -> dict[str, Any]:
    """A solo agent the fresh model has make ``appends`` fs.append calls, then answer."""
    return {
        "name": "fresh-solo",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": ["fs.append"],
        "model": fresh(f"fresh:appends={appends}"),
    }


def fanout_appender() -> dict[str, Any]:
    """A fanout the fresh model plans into two children, each making one fs.append call."""
    return {
        "name": "fresh-fanout",
        "version": "1.0.0",
        "coordination": "fanout",
        "coordination_params": {"max_parallel": 2},
        "model": fresh("fresh:plan=2"),
        "roles": {"worker": {"tools": ["fs.append"], "model": fresh("fresh:appends=1")}},
    }


def start(url: str, goal: str, definition: dict[str, Any]) -> str:
    response = httpx.post(f"{url}/v1/sessions", json={"goal": goal, "definition": definition})
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


def view(url: str, session_id: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/v1/sessions/{session_id}", timeout=10).json()
    return body


def records_of(url: str, session_id: str) -> list[EventRecord]:
    """The session's log up to its last event now."""
    last = view(url, session_id)["last_index"]
    records: list[EventRecord] = []
    with SyncClient(url) as client:
        for record in client.events(session_id):
            records.append(record)
            if record.index >= last:
                break
    return records


def wait_for(url: str, session_id: str, predicate: Any, what: str) -> list[EventRecord]:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        records = records_of(url, session_id)
        if predicate(records):
            return records
        time.sleep(0.1)
    raise AssertionError(f"session {session_id}: {what} did not happen")


def settle(url: str, session_id: str) -> dict[str, Any]:
    """Until the session ends, resuming it (as an operator) when it is recoverable."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        body = view(url, session_id)
        if body["status"] in ("completed", "failed", "cancelled"):
            return body
        listed = httpx.get(f"{url}/v1/recoverable", timeout=10).json()
        rows = listed["sessions"] if isinstance(listed, dict) else listed
        if any(r["session_id"] == session_id for r in rows):
            httpx.post(f"{url}/v1/sessions/{session_id}/resume", json={"confirm": True}, timeout=10)
        time.sleep(0.2)
    raise AssertionError(f"session {session_id} did not end")


def audited(system: ReplayMesh, session_id: str) -> Any:
    """The chaos audit of an ended session, which must be clean."""
    with SyncClient(system.url) as client:
        verification = client.verify_session(session_id)
    audit = audit_session(
        records_of(system.url, session_id),
        verification,
        system.mesh.daemon.workspace,
        system.server.log(),
        session_id=session_id,
    )
    assert audit.ok, audit.problems
    assert audit.status == "completed"
    assert audit.output_from_model is True
    return audit


def answers(server: FreshModelServer) -> list[dict[str, Any]]:
    return [c for c in server.log() if c.get("status") == 200]


def finals(server: FreshModelServer) -> list[str]:
    """Every final (or synthesis) text the server answered for an agent's own task."""
    return [
        str(c["answer"]["content"])
        for c in answers(server)
        if c["answer"].get("content") and PLAN_MARKER not in _system(c)
    ]


def plans(server: FreshModelServer) -> list[str]:
    return [str(c["answer"]["content"]) for c in answers(server) if PLAN_MARKER in _system(c)]


def _system(call: dict[str, Any]) -> str:
    messages = call["request"]["messages"]
    return next((m.get("content") or "" for m in messages if m.get("role") == "system"), "")


def asked_per_step(server: FreshModelServer) -> Counter[tuple[str, int]]:
    """How many answers the server gave for each (agent slot, tool-call step)."""
    return Counter((c["slot"], c["step"]) for c in answers(server) if c["answer"].get("tool_calls"))


def resumed_after_its_plan(records: list[EventRecord]) -> bool:
    """Whether the root was re-dispatched after its plan (its first snapshot) was recorded."""
    recorded = [
        r.index for r in records if r.kind == "AgentSnapshotted" and r.event["agent"] == "root"
    ]
    return bool(recorded) and any(
        r.kind == "AgentResuming" and r.event["agent"] == "root" and r.index > recorded[0]
        for r in records
    )


# --- the tests -----------------------------------------------------------------------------------


def test_a_kill_at_every_point_of_a_step_runs_each_effect_once_and_ends_with_the_models_answer(
    bare_mesh: Mesh,
) -> None:
    with FreshModelServer() as server:
        system = ReplayMesh(bare_mesh, server)
        definition = solo_appender(appends=3)
        session_id = start(system.url, "every point", definition)
        # Step 1: lost before its intent (nothing recorded yet: the model is asked again), then
        # lost between its intent and its effect (recorded: replayed, its outcome unknown).
        system.kill_at("intent")
        system.kill_at("effect")
        # Step 2: lost after its effect, before the report carrying its result.
        system.kill_at("report")
        # The final answer: lost between its report and Done.
        system.kill_at("done")
        ended = settle(system.url, session_id)
        audited(system, session_id)
        assert ended["status"] == "completed", ended
        # The answer is the one the model gave once, before the kill; never asked for again.
        assert finals(server) == [ended["output"]], (ended["output"], finals(server))
        # Only the step lost before its turn was recorded was asked for twice.
        asked = asked_per_step(server)
        assert sorted(asked.values()) == [1, 1, 2], asked
        lines = (system.mesh.daemon.workspace / session_id / "fresh").glob("*.txt")
        written = [line for path in lines for line in path.read_text().splitlines()]
        # Exactly once: the append cut short between its intent and its effect is put to
        # fs.append's probe, which finds it did not happen, so it runs once on the replay.
        assert len(written) == len(set(written)) == 3, written


def test_a_fanout_root_lost_before_its_plan_is_done_replays_the_plan_and_its_children_run(
    bare_mesh: Mesh,
) -> None:
    with FreshModelServer() as server:
        system = ReplayMesh(bare_mesh, server)
        definition = fanout_appender()
        session_id = start(system.url, "plan once", definition)
        # The root's worker freezes between its plan's report and Done, past the heartbeat
        # threshold: the root is re-dispatched elsewhere; thawed, the zombie's Done is fenced.
        system.arm("done")
        frozen = system.wait_hit("done")
        wait_for(system.url, session_id, resumed_after_its_plan, "the root's re-dispatch")
        frozen.thaw()
        ended = settle(system.url, session_id)
        audited(system, session_id)
        assert ended["status"] == "completed", ended
        (plan,) = plans(server)  # asked once: the recorded plan was replayed
        agents = {a["ref"]: a for a in ended["agents"]}
        children = sorted(ref for ref in agents if ref != "root")
        assert children == ["root/0", "root/1"], agents
        assert [agents[ref]["task"] for ref in children] == json.loads(plan)
        assert all(agents[ref]["phase"] == "completed" for ref in children), agents
        files = sorted((system.mesh.daemon.workspace / session_id / "fresh").glob("*.txt"))
        assert len(files) == 2 and all(len(f.read_text().splitlines()) == 1 for f in files)
        assert ended["output"] in finals(server)


def test_a_turn_stored_but_never_logged_is_never_replayed(bare_mesh: Mesh) -> None:
    """The daemon stops between storing the root's plan turn and logging its pointer: the
    worker never heard back, so nothing depended on that turn. The next daemon continues from
    the snapshot the log points to, so the plan is asked for again and later asks (the synthesis)
    are put to the model, never answered with the stored-but-unlogged plan."""
    gates = bare_mesh.base / "gates"
    # The daemon carries the kill points too (``turn-stored`` is a daemon's point).
    bare_mesh.daemon.env.update(kill_points_env(gates))
    with FreshModelServer() as server:
        system = ReplayMesh(bare_mesh, server)
        definition = fanout_appender()
        system.arm("turn-stored")
        session_id = start(system.url, "plan, unlogged", definition)
        assert system.wait_daemon_hit("turn-stored") == bare_mesh.daemon.pid
        bare_mesh.daemon.kill()
        bare_mesh.daemon.start()  # nothing had a side effect yet: the session resumes by itself
        ended = settle(system.url, session_id)
        audited(system, session_id)
        assert ended["status"] == "completed", ended
        asked = plans(server)
        assert len(asked) == 2, asked  # the unlogged plan was asked for again, once
        agents = {a["ref"]: a for a in ended["agents"]}
        children = sorted(ref for ref in agents if ref != "root")
        assert [agents[ref]["task"] for ref in children] == json.loads(asked[-1])
        assert ended["output"] in finals(server)  # the synthesis is the model's, not a plan


def test_a_daemon_killed_while_a_nodes_snapshot_waits_for_the_next_turn_replays_that_node(
    bare_mesh: Mesh,
) -> None:
    """A node's report rides on the agent's next turn's report, to be logged and committed
    with it. The daemon is SIGKILLed when that report has reached it and neither is stored nor
    logged: the next daemon continues from the turn the log points to, so the node is replayed
    (its effect's intent has no result: the probe finds the effect happened, and it is never
    run again) and only the turn that was never recorded is put to the model again."""
    gates = bare_mesh.base / "gates"
    bare_mesh.daemon.env.update(kill_points_env(gates))
    with FreshModelServer() as server:
        system = ReplayMesh(bare_mesh, server)
        system.arm("node-unstored")
        session_id = start(system.url, "node unstored", solo_appender(appends=3))
        assert system.wait_daemon_hit("node-unstored") == bare_mesh.daemon.pid
        bare_mesh.daemon.kill()
        bare_mesh.daemon.start()
        ended = settle(system.url, session_id)
        audited(system, session_id)
        assert ended["status"] == "completed", ended
        records = records_of(system.url, session_id)
        resuming = [r for r in records if r.kind == "AgentResuming"]
        assert resuming, "the agent was never resumed"
        pointers = {
            r.event["snapshot_id"]: r.event["source"]
            for r in records
            if r.kind == "AgentSnapshotted" and r.index < resuming[0].index
        }
        # The last snapshot logged before the kill is the first step's turn: its node was not.
        assert pointers[resuming[0].event["snapshot_id"]] == "turn", (resuming[0], pointers)
        lines = (system.mesh.daemon.workspace / session_id / "fresh").glob("*.txt")
        written = [line for path in lines for line in path.read_text().splitlines()]
        assert len(written) == len(set(written)) == 3, written
        # Only the second step's turn, answered but never recorded, was asked for twice.
        asked = asked_per_step(server)
        assert sorted(asked.values()) == [1, 1, 2], asked
        assert finals(server) == [ended["output"]]


def test_a_daemon_killed_after_an_effect_then_resumed_replays_the_turn_without_asking_again(
    bare_mesh: Mesh,
) -> None:
    with FreshModelServer() as server:
        system = ReplayMesh(bare_mesh, server)
        definition = solo_appender(appends=2)
        session_id = start(system.url, "daemon lost", definition)
        # The effect of step 1 ran; before its result is reported the daemon is SIGKILLed (and
        # the frozen worker with it), then started again: the session has a side effect, so it
        # waits for an operator, who resumes it.
        system.arm("report")
        frozen = system.wait_hit("report")
        asked_before = asked_per_step(server)
        system.mesh.daemon.kill()
        frozen.kill()
        system.mesh.daemon.start()
        system.worker()
        ended = settle(system.url, session_id)
        audited(system, session_id)
        assert ended["status"] == "completed", ended
        records = records_of(system.url, session_id)
        assert any(r.kind == "OperatorAction" and r.event["action"] == "resume" for r in records), (
            "the session was not resumed by an operator"
        )
        # The step whose effect ran was not asked for again: its recorded turn was replayed.
        # The frozen report also carried the next turn (asked while the node was held, never
        # recorded): that one alone may be asked for twice.
        asked = asked_per_step(server)
        unrecorded = max(asked_before)
        for slot_step, count in asked_before.items():
            if slot_step != unrecorded:
                assert asked[slot_step] == count, (slot_step, asked)
        assert asked[unrecorded] <= 2, asked
        assert {n for key, n in asked.items() if key != unrecorded} == {1}, asked
        assert finals(server) == [ended["output"]]


def test_a_question_answered_by_a_human_is_not_asked_again_in_other_words(bare_mesh: Mesh) -> None:
    with FreshModelServer() as server:
        system = ReplayMesh(bare_mesh, server)
        definition = {
            "name": "fresh-asker",
            "version": "1.0.0",
            "coordination": "solo",
            "tools": ["ask_human", "fs.append"],
            "model": fresh("fresh:asks=1,appends=1"),
        }
        session_id = start(system.url, "ask once", definition)
        deadline = time.monotonic() + TIMEOUT
        while not view(system.url, session_id).get("hitl_pending"):
            assert time.monotonic() < deadline, "the agent never asked"
            time.sleep(0.1)
        (pause,) = view(system.url, session_id)["hitl_pending"]
        response = httpx.post(
            f"{system.url}/v1/sessions/{session_id}/hitl/{pause['pause_id']}",
            json={"answer": "the blue one"},
        )
        assert response.status_code == 202, response.text
        # The dispatch after the answer replays the recorded turn: the same question, the same
        # pause, whose answer now waits (a model asked again would ask something else).
        ended = settle(system.url, session_id)
        audited(system, session_id)
        assert ended["status"] == "completed", ended
        questions = [
            c
            for c in answers(server)
            for t in c["answer"].get("tool_calls") or []
            if t["function"]["name"] == "ask_human"
        ]
        assert len(questions) == 1, questions
        records = records_of(system.url, session_id)
        assert [r.kind for r in records].count("HitlPaused") == 1
