"""Limits against bad or hostile input, on the production-shaped deployment of
``tests/e2e/secure_system.py`` (3-node cluster with auth and TLS, a leaf node, HTTPS API with
tokens) with small ``[limits]`` so each is easy to cross.

At the API edge an oversized goal, agent definition, skill body, request body or first event is
refused with 413 ``payload_too_large`` (the SDK raises ``PayloadTooLargeError``) and leaves no
session behind; on the worker control subjects an oversized report gets an error reply, and a tool
argument or snapshot over its limit fails the agent with a reason naming the limit. Tool
workspaces refuse absolute paths, ``..`` traversal and symlinks that lead out of them.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from tests.e2e.secure_system import SecureSystem

from apomesh.runtime.protocol import (
    ENCODER,
    REPLY_DECODER,
    VERB_NODE,
    control_subject,
    worker_inbox_prefix,
)
from apomesh.sdk.client import PayloadTooLargeError, SyncClient

pytestmark = pytest.mark.anyio

TIMEOUT = 90.0
GOAL_LIMIT = 1024
DEFINITION_LIMIT = 64 * 1024
SKILL_LIMIT = 4096
TOOL_ARGS_LIMIT = 2048
SNAPSHOT_LIMIT = 32 * 1024
EVENT_LIMIT = 16 * 1024
BODY_LIMIT = 128 * 1024


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureSystem]:
    deployment = SecureSystem.build(
        tmp_path_factory.mktemp("limits"),
        daemon_env={
            "APOMESH_LIMITS_MAX_GOAL_BYTES": str(GOAL_LIMIT),
            "APOMESH_LIMITS_MAX_DEFINITION_BYTES": str(DEFINITION_LIMIT),
            "APOMESH_LIMITS_MAX_SKILL_BYTES": str(SKILL_LIMIT),
            "APOMESH_LIMITS_MAX_TOOL_ARGS_BYTES": str(TOOL_ARGS_LIMIT),
            "APOMESH_LIMITS_MAX_SNAPSHOT_BYTES": str(SNAPSHOT_LIMIT),
            "APOMESH_LIMITS_MAX_EVENT_BYTES": str(EVENT_LIMIT),
            "APOMESH_HTTP_MAX_BODY_BYTES": str(BODY_LIMIT),
        },
    )
    try:
        deployment.worker("worker-a")
        deployment.wait_workers({"worker-a"})
        yield deployment
    finally:
        deployment.close()


def agent(turns: list[dict[str, Any]], tools: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": "limits",
        "version": "1",
        "tools": tools,
        "model": {"provider": "scripted", "turns": turns},
        **extra,
    }


def post_session(system: SecureSystem, body: dict[str, Any]) -> Any:
    with system.http() as client:
        return client.post("/v1/sessions", json=body)


def session_ids(system: SecureSystem) -> set[str]:
    with system.http() as client:
        return {row["session_id"] for row in client.get("/v1/sessions").json()["sessions"]}


def run_to_end(system: SecureSystem, definition: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    response = post_session(system, {"goal": "go", "definition": definition})
    assert response.status_code == 201, response.text
    session_id = str(response.json()["session_id"])
    deadline = time.monotonic() + TIMEOUT
    view: dict[str, Any] = {}
    with system.http() as client:
        while time.monotonic() < deadline:
            view = client.get(f"/v1/sessions/{session_id}").json()
            if view["status"] in ("completed", "failed", "cancelled"):
                return session_id, view
            time.sleep(0.1)
    raise AssertionError(f"session {session_id} did not end: {view}")


def events(system: SecureSystem, session_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    with (
        system.http() as client,
        client.stream("GET", f"/v1/sessions/{session_id}/events") as stream,
    ):
        for line in stream.iter_lines():
            if line.startswith("data:"):
                found.append(json.loads(line[5:]))
    return found


def assert_too_large(response: Any, what: str) -> None:
    assert response.status_code == 413, response.text
    body = response.json()
    assert body["error"] == "payload_too_large"
    assert what in body["message"] and "over the limit" in body["message"]


# --------------------------------------------------------------------------------------------
# the API edge


def test_an_oversized_goal_definition_or_skill_gets_413(system: SecureSystem) -> None:
    echo = agent([{"final": "ok"}], [])
    before = session_ids(system)
    assert_too_large(
        post_session(system, {"goal": "g" * (GOAL_LIMIT + 1), "definition": echo}), "the goal"
    )
    huge = {**echo, "instructions": "i" * (DEFINITION_LIMIT + 1)}
    assert_too_large(
        post_session(system, {"goal": "go", "definition": huge}), "the agent definition"
    )
    with system.http() as client:
        assert_too_large(
            client.put("/v1/skills/big", json={"body": "s" * (SKILL_LIMIT + 1)}), "the skill body"
        )
        assert client.get("/v1/skills/big").status_code == 404
        published = client.post("/v1/agents", json=huge)
        assert_too_large(published, "the agent definition")
    assert session_ids(system) == before


def test_a_request_body_over_the_cap_is_refused_before_it_is_read(system: SecureSystem) -> None:
    with system.http() as client:
        response = client.post(
            "/v1/sessions",
            content=b"{" + b" " * (BODY_LIMIT + 1),
            headers={"Content-Type": "application/json"},
        )
    assert_too_large(response, "request body")


def test_a_first_event_over_the_limit_gets_413_and_leaves_no_session(
    system: SecureSystem,
) -> None:
    # Under the definition limit, but SessionStarted freezes it whole: over the event limit.
    definition = agent([{"final": "ok"}], [], instructions="i" * (EVENT_LIMIT + 1))
    before = session_ids(system)
    assert_too_large(post_session(system, {"goal": "go", "definition": definition}), "event")
    assert session_ids(system) == before


def test_the_sdk_raises_a_typed_error(
    system: SecureSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(system.pki.ca))
    client = SyncClient(system.daemon.url, token=system.tokens["operator"])
    try:
        with pytest.raises(PayloadTooLargeError, match="over the limit"):
            client.start_session("g" * (GOAL_LIMIT + 1), definition=agent([{"final": "ok"}], []))
    finally:
        client.close()


# --------------------------------------------------------------------------------------------
# worker reports


def test_a_tool_argument_over_the_limit_fails_the_agent_naming_the_limit(
    system: SecureSystem,
) -> None:
    content = "c" * (TOOL_ARGS_LIMIT + 1)
    definition = agent(
        [
            {"tool_calls": [{"tool": "fs.write", "args": {"path": "big.txt", "content": content}}]},
            {"final": "wrote it"},
        ],
        ["fs.write"],
    )
    session_id, view = run_to_end(system, definition)
    assert view["status"] == "failed", view
    assert "tool arguments of" in json.dumps(view) and "over the limit" in json.dumps(view)
    kinds = [record["kind"] for record in events(system, session_id)]
    assert "ToolCallIntent" not in kinds  # refused before anything was journaled
    assert not (system.base / "workspace-worker-a" / session_id / "big.txt").exists()


def test_a_snapshot_over_the_limit_fails_the_agent_naming_the_limit(system: SecureSystem) -> None:
    workspace = system.base / "workspace-worker-a"
    (workspace / "large.txt").write_text("l" * (SNAPSHOT_LIMIT + 1))
    definition = agent(
        [
            {"tool_calls": [{"tool": "fs.read", "args": {"path": "large.txt"}}]},
            {"final": "read it"},
        ],
        ["fs.read"],
        workspace="shared",  # it reads the file the test put there
    )
    session_id, view = run_to_end(system, definition)
    assert view["status"] == "failed", view
    assert "snapshot of" in json.dumps(view) and "over the limit" in json.dumps(view)
    kinds = [record["kind"] for record in events(system, session_id)]
    assert "AgentSnapshotted" not in kinds


async def test_an_oversized_report_on_a_control_subject_gets_an_error_reply(
    system: SecureSystem,
) -> None:
    login = system.logins["worker-c"]
    options = login.connect_options(system.pki)
    nc = await nats.connect(
        system.cluster.urls,
        tls=options["tls"],
        user=login.name,
        password=login.password,
        inbox_prefix=worker_inbox_prefix("worker-c"),
        allow_reconnect=False,
    )
    try:
        payload = ENCODER.encode({"junk": "j" * (SNAPSHOT_LIMIT + 8192)})
        reply = await nc.request(
            control_subject(system.daemon.daemon_id, VERB_NODE, "worker-c"), payload, timeout=10
        )
    finally:
        await nc.close()
    answer = REPLY_DECODER.decode(reply.data)
    assert answer.status == "error"
    assert answer.message.startswith("payload_too_large") and "over the limit" in answer.message


# --------------------------------------------------------------------------------------------
# workspaces


def test_tool_workspaces_refuse_traversal_absolute_paths_and_escaping_symlinks(
    system: SecureSystem, tmp_path: Path
) -> None:
    workspace = system.base / "workspace-worker-a"
    outside = tmp_path / f"outside-{secrets.token_hex(4)}"
    outside.mkdir()
    (workspace / "exit").symlink_to(outside, target_is_directory=True)
    escapes = [
        {"tool": "fs.write", "args": {"path": "../escaped.txt", "content": "out"}},
        {"tool": "fs.write", "args": {"path": str(outside / "absolute.txt"), "content": "out"}},
        {"tool": "fs.append", "args": {"path": "exit/through-link.txt", "line": "out"}},
        {"tool": "fs.write", "args": {"path": "inside.txt", "content": "in"}},
    ]
    definition = agent(
        [{"tool_calls": [call]} for call in escapes] + [{"final": "tried"}],
        ["fs.write", "fs.append"],
        workspace="shared",  # where the test made the symlink
    )
    session_id, view = run_to_end(system, definition)
    assert view["status"] == "completed", view
    recorded = [
        record["event"]
        for record in events(system, session_id)
        if record["kind"] == "ToolCallRecorded"
    ]
    outcomes = [(event["tool"], event["outcome"], event["result"]) for event in recorded]
    assert [outcome for _, outcome, _ in outcomes] == ["error", "error", "error", "ok"], outcomes
    assert "climbs out of the workspace" in outcomes[0][2]
    assert "outside the workspace" in outcomes[1][2]
    assert "symlink" in outcomes[2][2]
    assert list(outside.iterdir()) == []
    assert not (workspace.parent / "escaped.txt").exists()
    assert (workspace / "inside.txt").read_text() == "in"
