"""An agent's conversation (``GET /v1/sessions/{id}/agents/{ref}``) on a real daemon with worker
processes: model text, a read-only and a journaled tool call with their arguments and results, a
question to a human and its answer, read through the API, the async and the sync SDK and
``apomesh sessions agent`` (which prints brackets as they are); a sub-agent's ref with a ``/``;
and a side effect whose outcome is unknown, in a session a SIGKILLed daemon left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from tests.e2e.api_support import fanout_writer, start, start_mesh, stop_mesh, wait_status
from tests.e2e.chaos_kit import appender, shape_of, stored_session

from apomesh.adapters.jetstream_log import JetStreamLog
from apomesh.adapters.nats_connect import connect
from apomesh.sdk import AgentConversation, Client, NotFoundError, SyncClient
from apomesh.testing import Mesh

TALKER = {
    "name": "talker",
    "version": "1.0.0",
    "coordination": "solo",
    "instructions": "Write the note, then ask before shipping.",
    "tools": ["fs.list", "fs.append", "ask_human"],
    "model": {
        "provider": "scripted",
        "turns": [
            {
                "text": "Let me look first.",
                "tool_calls": [{"tool": "fs.list", "args": {"path": "."}}],
            },
            {
                "text": "Writing the [red]note[/red].",
                "tool_calls": [
                    {"tool": "fs.append", "args": {"path": "talk.txt", "line": "fix [bug] now"}}
                ],
            },
            {"tool_calls": [{"tool": "ask_human", "args": {"question": "Ship [v1]?"}}]},
            {"final": "shipped [v1]"},
        ],
    },
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    system = start_mesh(tmp_path_factory.mktemp("conversation"))
    try:
        yield system
    finally:
        stop_mesh(system)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "apomesh", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "60"},
    )


def kinds(talk: AgentConversation) -> list[str]:
    return [entry.kind for entry in talk.entries]


def test_a_conversation_shows_text_tools_and_the_human_answer(mesh: Mesh) -> None:
    session_id = start(mesh.url, "write and ship the note", TALKER)
    paused = wait_status(mesh.url, session_id, ("paused",))
    pause = paused["hitl_pending"][0]

    # While it waits: the question is there, with no answer yet.
    with SyncClient(mesh.url) as client:
        waiting = client.agent_conversation(session_id, "root")
        assert kinds(waiting)[-1] == "question"
        assert waiting.entries[-1].text == "Ship [v1]?"
        assert waiting.entries[-1].pause_id == pause["pause_id"]
        client.answer_hitl(session_id, pause["pause_id"], "Yes [now]")
        wait_status(mesh.url, session_id, ("completed",))
        talk = client.agent_conversation(session_id, "root")

    assert talk.agent.ref == "root" and talk.agent.phase == "completed"
    assert talk.agent.reason is None  # not "waiting for a human answer" any more
    assert talk.instructions == "Write the note, then ask before shipping."
    assert kinds(talk) == [
        "prompt",
        "model",
        "tool_call",
        "tool_result",
        "model",
        "tool_call",
        "tool_result",
        "question",
        "answer",
        "output",
    ]
    entries = talk.entries
    assert "write and ship the note" in entries[0].text
    assert entries[1].text == "Let me look first."
    listed, listing = entries[2], entries[3]
    assert (listed.tool, listed.args, listed.key) == ("fs.list", {"path": "."}, "")
    assert listing.call_id == listed.call_id and listing.outcome == "ok"
    assert entries[4].text == "Writing the [red]note[/red]."
    append, appended = entries[5], entries[6]
    assert append.tool == "fs.append"
    assert append.args == {"path": "talk.txt", "line": "fix [bug] now"}
    assert append.key and append.index > 0 and append.at > 0  # journaled: on the log
    assert (appended.key, appended.outcome) == (append.key, "ok")
    assert appended.index > append.index
    question, answer = entries[7], entries[8]
    assert question.text == "Ship [v1]?" and question.pause_id == pause["pause_id"]
    assert (answer.text, answer.pause_id) == ("Yes [now]", pause["pause_id"])
    assert answer.by and answer.index > question.index
    assert entries[9].text == "shipped [v1]"
    assert talk.unknown_outcomes == []

    # The raw API answers the same, and the async SDK too.
    raw = httpx.get(f"{mesh.url}/v1/sessions/{session_id}/agents/root", timeout=30)
    assert raw.status_code == 200
    assert [e["kind"] for e in raw.json()["entries"]] == kinds(talk)

    async def read() -> AgentConversation:
        async with Client(mesh.url) as client:
            return await client.agent_conversation(session_id, "root")

    assert anyio.run(read) == talk

    # The CLI prints it as it is: brackets are text, not markup.
    shown = cli("sessions", "agent", session_id, "root", "--url", mesh.url)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    for text in ("Writing the [red]note[/red].", "fix [bug] now", "Ship [v1]?", "Yes [now]"):
        assert text in out, out
    assert "shipped [v1]" in out and append.key in out
    assert "\n" not in shown.stdout.strip().splitlines()[0]

    missing = httpx.get(f"{mesh.url}/v1/sessions/{session_id}/agents/root/7", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"
    with SyncClient(mesh.url) as client, pytest.raises(NotFoundError):
        client.agent_conversation("no-such-session", "root")
    usage = cli("sessions", "agent", session_id, "--url", mesh.url)
    assert usage.returncode == 2 and "agent ref" in usage.stderr


def test_a_sub_agent_is_read_by_its_ref(mesh: Mesh) -> None:
    session_id = start(mesh.url, "three parts", fanout_writer("talk", 2, 0.05))
    wait_status(mesh.url, session_id, ("completed",))
    with SyncClient(mesh.url) as client:
        talk = client.agent_conversation(session_id, "root/1")
        root = client.agent_conversation(session_id, "root")
    assert talk.agent.ref == "root/1" and talk.agent.task == "part two"
    calls = [e for e in talk.entries if e.kind == "tool_call"]
    assert [c.args["line"] for c in calls] == ["part two: line 1", "part two: line 2"]
    assert all(c.key for c in calls)
    assert kinds(talk)[-1] == "output" and talk.entries[-1].text == "wrote part two"
    assert any("part three" in e.text for e in root.entries) and kinds(root)[-1] == "output"


async def write_log(mesh: Mesh, envelopes: list[Any]) -> None:
    nc = await connect([mesh.nats_url])
    try:
        log = JetStreamLog(nc)
        await log.ensure()
        await log.append(envelopes[0].session_id, envelopes)
    finally:
        await nc.close()


def test_an_unknown_outcome_is_part_of_the_conversation(mesh: Mesh) -> None:
    args = {"path": "chaos/talk-unknown.txt", "line": "maybe [once]"}
    session_id = uuid.uuid4().hex
    # The daemon died between logging the intent and hearing the result.
    log = stored_session(
        session_id,
        shape_of(appender(2)),
        goal="talk-unknown",
        events=5,
        open_intent=("fs.append", args),
    )
    anyio.run(write_log, mesh, log)
    mesh.daemon.kill()
    mesh.daemon.start()
    wait_status(mesh.url, session_id, ("recoverable",))
    with SyncClient(mesh.url) as client:
        talk = client.agent_conversation(session_id, "root")
    assert kinds(talk)[-2:] == ["tool_call", "unknown_outcome"]
    call, unknown = talk.entries[-2:]
    assert (call.tool, call.args) == ("fs.append", args) and call.index == len(log) - 1
    assert (unknown.key, unknown.outcome) == (call.key, "unknown")
    assert [(u.tool, u.key) for u in talk.unknown_outcomes] == [("fs.append", call.key)]
    text = cli("sessions", "agent", session_id, "root", "--url", mesh.url)
    assert "UNKNOWN fs.append" in text.stdout and "maybe [once]" in text.stdout
