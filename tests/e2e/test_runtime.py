"""The runtime end to end on real processes: an ``apomesh serve`` daemon, ``apomesh worker``
processes and a real nats-server (the ``mesh`` fixture). Each coordination kind runs to completion;
a human-in-the-loop pause is answered through the CLI and through the REST API; a budget runs out;
the loop-guard supervisor resets a looping agent; an async job resumes its agent; the ``openai``
provider talks to a local server speaking that protocol; a SIGTERM'd daemon resumes its session.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from tests.fakes.openai_server import FakeOpenAIServer

from apomesh.runtime.composition import load_definition_file
from apomesh.sdk.client import EventRecord, SyncClient
from apomesh.testing import Mesh

DEFINITIONS = Path(__file__).parent / "definitions"
TIMEOUT = 60.0


def definition(name: str) -> dict[str, Any]:
    return load_definition_file(DEFINITIONS / f"{name}.toml")


def start(url: str, goal: str, agent: dict[str, Any]) -> str:
    response = httpx.post(f"{url}/v1/sessions", json={"goal": goal, "definition": agent})
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


def view(url: str, session_id: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/sessions/{session_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def wait_until(url: str, session_id: str, predicate: Any, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    current: dict[str, Any] = {}
    while time.monotonic() < deadline:
        current = view(url, session_id)
        if predicate(current):
            return current
        time.sleep(0.05)
    raise AssertionError(f"session {session_id} never {what}: {current}")


def wait_ended(url: str, session_id: str) -> dict[str, Any]:
    return wait_until(
        url, session_id, lambda v: v["status"] in ("completed", "failed", "cancelled"), "ended"
    )


def log_of(url: str, session_id: str) -> list[EventRecord]:
    """The whole log of an ended session, through the SSE endpoint."""
    with SyncClient(url) as client:
        return list(client.events(session_id))


def kinds(records: list[EventRecord]) -> list[str]:
    return [r.kind for r in records]


def lifecycle(records: list[EventRecord], agent: str) -> list[str]:
    return [
        r.event["phase"]
        for r in records
        if r.kind == "AgentLifecycle" and r.event["agent"] == agent
    ]


# --- coordination kinds ------------------------------------------------------------------------


def test_solo_session_writes_its_file_and_completes(shared_mesh: Mesh) -> None:
    session_id = start(shared_mesh.url, "hello world", definition("solo"))
    ended = wait_ended(shared_mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "wrote hello world"
    assert ended["side_effects"] == 1
    assert (shared_mesh.daemon.workspace / session_id / "solo.txt").read_text() == "hello world"
    records = log_of(shared_mesh.url, session_id)
    assert kinds(records)[0] == "SessionStarted"
    assert kinds(records)[-1] == "SessionEnded"
    assert [r.index for r in records] == list(range(len(records)))
    assert lifecycle(records, "root")[-1] == "completed"
    assert kinds(records).count("ToolCallIntent") == kinds(records).count("ToolCallRecorded") == 1


def test_fanout_sub_agents_write_their_files(shared_mesh: Mesh) -> None:
    session_id = start(shared_mesh.url, "a three-part story", definition("fanout"))
    ended = wait_ended(shared_mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "all parts written"
    tasks = ["alpha", "beta", "gamma"]
    for index, task in enumerate(tasks):
        lines = (
            (shared_mesh.daemon.workspace / session_id / f"part-{index}.txt")
            .read_text()
            .splitlines()
        )
        assert lines == [f"{task}: first line", f"{task}: second line"]
        assert (
            shared_mesh.daemon.workspace / session_id / f"done-{index}.txt"
        ).read_text() == f"{task} done"
    children = [a for a in ended["agents"] if a["parent"] == "root"]
    assert sorted(a["task"] for a in children) == tasks
    assert all(a["phase"] == "completed" for a in children)
    assert ended["side_effects"] == 9
    records = log_of(shared_mesh.url, session_id)
    assert "CoordinatorCheckpoint" in kinds(records)
    # The root planned, then synthesized from its children's results.
    assert lifecycle(records, "root").count("planned") == 1
    assert lifecycle(records, "root")[-1] == "completed"


def test_refine_iterates_once_then_answers(shared_mesh: Mesh) -> None:
    session_id = start(shared_mesh.url, "an essay", definition("refine"))
    ended = wait_ended(shared_mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "refined after two rounds"
    # One sub-agent per round: the first plan, then the plan the critique asked for.
    assert (shared_mesh.daemon.workspace / session_id / "refine.txt").read_text().splitlines() == [
        "draft",
        "revise",
    ]
    children = [a for a in ended["agents"] if a["parent"] == "root"]
    assert [(a["task"], a["batch"], a["phase"]) for a in children] == [
        ("draft", "iter-1", "completed"),
        ("revise", "iter-2", "completed"),
    ]
    records = log_of(shared_mesh.url, session_id)
    positions = [r.event["position"] for r in records if r.kind == "CoordinatorCheckpoint"]
    assert positions == ["planned@1", "executed@1", "planned@2", "executed@2"]


# --- human in the loop -------------------------------------------------------------------------


def _paused(url: str, session_id: str) -> dict[str, Any]:
    return wait_until(
        url, session_id, lambda v: v["status"] == "paused" and v["hitl_pending"], "paused"
    )


def _check_answered_log(records: list[EventRecord], answer: str) -> None:
    names = kinds(records)
    assert names.count("HitlPaused") == 1, names
    assert names.count("HitlAnswered") == 1, names
    answered = next(r for r in records if r.kind == "HitlAnswered")
    assert answered.event["answer"] == answer
    assert names.index("HitlPaused") < names.index("HitlAnswered")
    # The write that follows the answer ran after it, once.
    intents = [r for r in records if r.kind == "ToolCallIntent"]
    assert [r.event["tool"] for r in intents] == ["fs.write"]
    assert intents[0].index > answered.index
    phases = lifecycle(records, "root")
    assert "paused" in phases
    assert phases[-1] == "completed"


def test_hitl_pause_answered_through_the_cli(shared_mesh: Mesh) -> None:
    session_id = start(shared_mesh.url, "design a cover", definition("hitl"))
    paused = _paused(shared_mesh.url, session_id)
    (pause,) = paused["hitl_pending"]
    assert pause["agent"] == "root"
    assert pause["question"] == "Which colour should the cover be?"
    assert not (shared_mesh.daemon.workspace / session_id / "after-answer.txt").exists()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "apomesh",
            "hitl",
            "answer",
            session_id,
            pause["pause_id"],
            "blue",
            "--url",
            shared_mesh.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ended = wait_ended(shared_mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "cover chosen"
    assert ended["hitl_pending"] == []
    assert (
        shared_mesh.daemon.workspace / session_id / "after-answer.txt"
    ).read_text() == "the human answered"
    _check_answered_log(log_of(shared_mesh.url, session_id), "blue")
    # The pause is closed: answering it again is refused.
    again = httpx.post(
        f"{shared_mesh.url}/v1/sessions/{session_id}/hitl/{pause['pause_id']}",
        json={"answer": "red"},
    )
    assert again.status_code >= 400


def test_hitl_pause_answered_through_the_api(shared_mesh: Mesh) -> None:
    session_id = start(shared_mesh.url, "design a cover", definition("hitl"))
    (pause,) = _paused(shared_mesh.url, session_id)["hitl_pending"]
    response = httpx.post(
        f"{shared_mesh.url}/v1/sessions/{session_id}/hitl/{pause['pause_id']}",
        json={"answer": "green"},
    )
    assert response.status_code == 202, response.text
    ended = wait_ended(shared_mesh.url, session_id)
    assert ended["status"] == "completed", ended
    _check_answered_log(log_of(shared_mesh.url, session_id), "green")


# --- budgets, supervisors, async jobs ----------------------------------------------------------


def test_exhausted_budget_fails_the_agent_and_the_session(shared_mesh: Mesh) -> None:
    session_id = start(shared_mesh.url, "spend", definition("budget"))
    ended = wait_ended(shared_mesh.url, session_id)
    assert ended["status"] == "failed", ended
    assert "max_steps 2" in ended["reason"]
    (root,) = ended["agents"]
    assert root["phase"] == "failed"
    assert "budget exhausted: max_steps 2" in root["reason"]
    records = log_of(shared_mesh.url, session_id)
    steps = [r.event["step"] for r in records if r.kind == "AgentSnapshotted"]
    assert max(steps) == 2


def test_loop_guard_resets_a_looping_agent_which_then_completes(shared_mesh: Mesh) -> None:
    session_id = start(shared_mesh.url, "loop", definition("looping"))
    ended = wait_ended(shared_mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "stopped looping"
    records = log_of(shared_mesh.url, session_id)
    snapshots = [r.event for r in records if r.kind == "AgentSnapshotted"]
    sources = [s["source"] for s in snapshots]
    assert sources.count("reset_point") == 1, sources
    reset_at = sources.index("reset_point")
    # The reset point is taken at the fourth identical call, and the agent goes on after it.
    assert snapshots[reset_at]["step"] == 4
    # After it: the fresh start's node, then the final answer, recorded as a turn.
    assert sources[reset_at + 1 :] == ["node", "turn"]
    assert snapshots[-1]["step"] == 5
    assert lifecycle(records, "root")[-1] == "completed"


def test_async_job_resumes_its_agent(shared_mesh: Mesh) -> None:
    session_id = start(shared_mesh.url, "nap", definition("job"))
    ended = wait_ended(shared_mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "slept"
    records = log_of(shared_mesh.url, session_id)
    names = kinds(records)
    assert names.count("AsyncJobStarted") == 1, names
    assert names.count("AsyncJobFinished") == 1, names
    started = records[names.index("AsyncJobStarted")]
    finished = records[names.index("AsyncJobFinished")]
    assert started.event["tool"] == "jobs.sleep"
    assert started.event["args"] == {"seconds": 0.5}
    assert finished.event["ok"] is True
    assert finished.event["result"] == "slept 0.5 s"
    assert finished.event["job_id"] == started.event["job_id"]
    phases = lifecycle(records, "root")
    assert "waiting" in phases
    assert phases[-1] == "completed"
    # The agent was dispatched again after the job finished, and that dispatch answered.
    last_dispatch = max(
        r.index for r in records if r.kind == "AgentLifecycle" and r.event["phase"] == "dispatched"
    )
    assert last_dispatch > finished.index


# --- the openai provider -----------------------------------------------------------------------


def test_openai_provider_against_a_local_protocol_server(bare_mesh: Mesh) -> None:
    with FakeOpenAIServer() as fake:
        fake.reply(
            None, tool_calls=[("fs__write", {"path": "openai.txt", "content": "from the model"})]
        )
        fake.reply("the file is written", total_tokens=12)
        # The endpoint and its key are configured on the daemon (checked when the session is
        # created) and on a worker of its own, with the API key in its environment; the bare_mesh's
        # scripted-only workers cannot be told apart by provider, so stop them first.
        config = bare_mesh.base / "openai.toml"
        config.write_text(
            "[providers.openai.credentials.fake]\n"
            f'base_url = "{fake.base_url}"\napi_key_env = "FAKE_OPENAI_KEY"\n'
        )
        for worker in bare_mesh.workers:
            worker.stop()
        bare_mesh.daemon.extra_args = ("--config", str(config))
        bare_mesh.daemon.restart()
        bare_mesh.worker("keyed", env={"FAKE_OPENAI_KEY": "sk-test-123"}, config=config)
        agent = {
            "name": "openai-writer",
            "coordination": "solo",
            "instructions": "Write what you are asked.",
            "tools": ["fs.write"],
            "model": {
                "provider": "openai",
                "model": "fake-model",
                "credential": "fake",
                "temperature": 0,
            },
        }
        session_id = start(bare_mesh.url, "write openai.txt", agent)
        ended = wait_ended(bare_mesh.url, session_id)
        assert ended["status"] == "completed", ended
        assert ended["output"] == "the file is written"
        assert (
            bare_mesh.daemon.workspace / session_id / "openai.txt"
        ).read_text() == "from the model"
        (root,) = ended["agents"]
        assert root["worker"].startswith("keyed")
        assert len(fake.requests) == 2
        first, second = (r.body for r in fake.requests)
        assert first["model"] == "fake-model"
        assert first["temperature"] == 0
        assert first["messages"][0] == {"role": "system", "content": "Write what you are asked."}
        assert {t["function"]["name"] for t in first["tools"]} == {"fs__write"}
        # The second request carries the tool result that answers the model's call.
        assert second["messages"][-1]["role"] == "tool"
        assert "wrote" in second["messages"][-1]["content"]
        assert all(r.headers.get("Authorization") == "Bearer sk-test-123" for r in fake.requests)


# --- clean shutdown ----------------------------------------------------------------------------


def test_sigterm_mid_session_then_restart_resumes_and_loses_nothing(mesh: Mesh) -> None:
    session_id = start(mesh.url, "read slowly", definition("slow"))
    # Mid-session: the agent has finished a couple of nodes but not all eight.
    wait_until(
        mesh.url,
        session_id,
        lambda v: any(a["phase"] == "running" for a in v["agents"]) and v["last_index"] >= 6,
        "ran a few nodes",
    )
    before: list[EventRecord] = []
    with SyncClient(mesh.url) as client:
        seen = view(mesh.url, session_id)["last_index"]
        for record in client.events(session_id):
            before.append(record)
            if record.index >= seen:
                break
    mesh.daemon.stop()  # SIGTERM, and waits for the process to exit
    assert mesh.daemon.proc.returncode == 0, mesh.daemon.output_tail()
    mesh.daemon.start()
    ended = wait_ended(mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "read the workspace eight times"
    after = log_of(mesh.url, session_id)
    assert [r.index for r in after] == list(range(len(after)))
    for old in before:
        assert after[old.index].event_id == old.event_id
        assert after[old.index].kind == old.kind
    names = kinds(after)
    assert names.count("SessionRecovered") == 1
    recovered = after[names.index("SessionRecovered")]
    assert recovered.event["path"] == "auto"
    assert recovered.index > before[-1].index
    assert ended["side_effects"] == 0


def test_an_open_pause_survives_a_daemon_restart(mesh: Mesh) -> None:
    session_id = start(mesh.url, "design a cover", definition("hitl"))
    (pause,) = _paused(mesh.url, session_id)["hitl_pending"]
    mesh.daemon.stop()
    mesh.daemon.start()
    # The restarted daemon still lists the same pause, and takes its answer.
    (again,) = _paused(mesh.url, session_id)["hitl_pending"]
    assert again == pause
    response = httpx.post(
        f"{mesh.url}/v1/sessions/{session_id}/hitl/{pause['pause_id']}", json={"answer": "teal"}
    )
    assert response.status_code == 202, response.text
    ended = wait_ended(mesh.url, session_id)
    assert ended["status"] == "completed", ended
    records = log_of(mesh.url, session_id)
    _check_answered_log(records, "teal")
    assert kinds(records).count("SessionRecovered") == 1


def test_an_async_job_in_flight_at_shutdown_finishes_after_the_restart(mesh: Mesh) -> None:
    agent = definition("job")
    agent["model"]["turns"][0]["tool_calls"][0]["args"]["seconds"] = 3
    session_id = start(mesh.url, "nap", agent)
    wait_until(
        mesh.url, session_id, lambda v: v["agents"][0]["phase"] == "waiting", "waited for its job"
    )
    mesh.daemon.stop()
    mesh.daemon.start()
    ended = wait_ended(mesh.url, session_id)
    assert ended["status"] == "completed", ended
    assert ended["output"] == "slept"
    records = log_of(mesh.url, session_id)
    names = kinds(records)
    assert names.count("AsyncJobStarted") == names.count("AsyncJobFinished") == 1, names
    # The job the first daemon started was taken up again by the second, which logged its end.
    assert names.index("SessionRecovered") < names.index("AsyncJobFinished")
    assert records[names.index("AsyncJobFinished")].event["result"] == "slept 3 s"
