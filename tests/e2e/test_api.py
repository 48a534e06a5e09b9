"""Every REST endpoint of the contract against a real daemon: an ``apomesh serve`` process on a real
nats-server with worker processes. Statuses and bodies, the stable error codes, size limits, the
catalogs, workers, health, Prometheus metrics, the OpenAPI document, cancelling, answering a pause,
and the recoverable list with its preview-then-confirm resume after the daemon was killed."""

from __future__ import annotations

import hashlib
import re
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from tests.e2e.api_support import (
    ECHO,
    appender,
    asker,
    fanout_writer,
    journal_lines,
    slow_reader,
    start,
    start_mesh,
    stop_mesh,
    view,
    wait_event,
    wait_status,
    wait_until,
)

from apomesh.testing import Mesh

DOCS_API = Path(__file__).resolve().parents[2] / "docs" / "api.md"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One daemon and two workers shared by the tests that neither kill nor restart anything."""
    mesh = start_mesh(tmp_path_factory.mktemp("api"))
    try:
        yield mesh
    finally:
        stop_mesh(mesh)


@pytest.fixture
def http(system: Mesh) -> Iterator[httpx.Client]:
    # As the SDK does: every write says JSON, or the API refuses it (415).
    with httpx.Client(base_url=system.url, timeout=30, headers=JSON) as client:
        yield client


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body: dict[str, Any] = response.json()
    assert body["error"] == code, body
    assert isinstance(body["message"], str) and body["message"]
    return body


# --- the OpenAPI document ------------------------------------------------------------------


def documented_routes() -> set[tuple[str, str]]:
    """(method, path) of every row of the endpoint table in docs/api.md."""
    routes: set[tuple[str, str]] = set()
    for match in re.finditer(r"^\| `([A-Z, ]+) (/[^`? ]*)[^`]*` \|", DOCS_API.read_text(), re.M):
        methods, path = match.groups()
        for method in methods.replace(" ", "").split(","):
            routes.add((method, path))
    return routes


def shape(path: str) -> str:
    """A path with its parameters unnamed: ``/v1/sessions/{id}`` and ``/v1/sessions/{session_id}``
    are the same route."""
    return re.sub(r"\{[^}]+\}", "{}", path)


def test_openapi_lists_every_route_and_every_route_answers(http: httpx.Client) -> None:
    response = http.get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.1")
    served = {
        (method.upper(), path)
        for path, operations in document["paths"].items()
        for method in operations
    }
    documented = documented_routes()
    assert len(documented) >= 20
    shapes = {(method, shape(path)) for method, path in served}
    missing = {
        (method, path)
        for method, path in documented
        if path != "/static/{path}" and (method, shape(path)) not in shapes
    }
    assert not missing, f"routes in docs/api.md but not in /openapi.json: {sorted(missing)}"
    assert ("GET", "/static/{path}") in served or any(p.startswith("/static") for _, p in served)
    for method, path in sorted(served):
        concrete = (
            path.replace("{session_id}", "nope")
            .replace("{pause_id}", "nope")
            .replace("{name}", "nope")
            .replace("{path}", "app.css")
        )
        answer = http.request(method, concrete, json={} if method in ("POST", "PUT") else None)
        # The router knows every documented route: a miss would be a plain 404 with the router's
        # message, a wrong method 405. Handlers answer their own (typed) codes.
        assert answer.status_code != 405, (method, path)
        if answer.status_code == 404:
            assert answer.json()["error"] == "not_found"
            assert "{" in path, (method, path, answer.text)


def test_unknown_paths_and_methods_answer_json(http: httpx.Client) -> None:
    error_of(http.get("/v1/nothing-here"), 404, "not_found")
    error_of(http.delete("/v1/sessions"), 405, "method_not_allowed")


# --- sessions ---------------------------------------------------------------------------------


def test_a_session_from_an_inline_definition_completes(http: httpx.Client, system: Mesh) -> None:
    response = http.post("/v1/sessions", json={"goal": "say hello", "definition": ECHO})
    assert response.status_code == 201
    session_id = response.json()["session_id"]
    assert list(response.json()) == ["session_id"]
    done = wait_status(system.url, session_id)
    assert done["status"] == "completed"
    assert done["session_id"] == session_id
    assert done["goal"] == "say hello"
    assert done["output"] == "done: say hello"
    assert done["side_effects"] == 0
    assert done["last_index"] >= 4
    assert done["coordination"] == "solo"
    (root,) = done["agents"]
    assert root["ref"] == "root" and root["parent"] is None
    assert root["name"] == "echo" and root["phase"] == "completed"
    assert root["worker"] in {w["id"] for w in http.get("/v1/workers").json()["workers"]}


def test_a_goal_alone_runs_the_default_agent(http: httpx.Client, system: Mesh) -> None:
    response = http.post("/v1/sessions", json={"goal": "just this"})
    assert response.status_code == 201, response.text
    done = wait_status(system.url, response.json()["session_id"])
    assert done["status"] == "completed" and done["output"] == "done: just this"


def test_a_published_agent_is_created_once_and_runs(http: httpx.Client, system: Mesh) -> None:
    definition = {**ECHO, "name": "greeter", "version": "1.0.0"}
    first = http.post("/v1/agents", json=definition)
    assert first.status_code == 201, first.text
    record = first.json()
    assert record["name"] == "greeter" and record["version"] == "1.0.0"
    assert len(record["digest"]) == 64
    assert record["definition"]["name"] == "greeter"
    assert any(p["name"] == "apomesh" for p in record["plugins"])
    again = http.post("/v1/agents", json=definition)
    assert again.status_code == 200
    assert again.json()["digest"] == record["digest"]
    changed = {**definition, "instructions": "Something else."}
    error_of(http.post("/v1/agents", json=changed), 409, "publish_conflict")
    newer = http.post("/v1/agents", json={**changed, "version": "1.1.0"})
    assert newer.status_code == 201

    listed = http.get("/v1/agents").json()["agents"]
    assert {("greeter", "1.0.0"), ("greeter", "1.1.0")} <= {
        (a["name"], a["version"]) for a in listed
    }
    assert http.get("/v1/agents/greeter").json()["version"] == "1.1.0"
    pinned = http.get("/v1/agents/greeter", params={"version": "1.0.0"}).json()
    assert pinned["digest"] == record["digest"]
    error_of(http.get("/v1/agents/greeter", params={"version": "9.9.9"}), 404, "not_found")
    error_of(http.get("/v1/agents/nobody"), 404, "not_found")

    by_object = start(system.url, "hi", agent={"name": "greeter", "version": "1.0.0"})
    by_string = start(system.url, "hello", agent="greeter@1.1.0")
    latest = start(system.url, "hey", agent="greeter")
    for session_id, goal in ((by_object, "hi"), (by_string, "hello"), (latest, "hey")):
        done = wait_status(system.url, session_id)
        assert done["status"] == "completed" and done["output"] == f"done: {goal}"
    error_of(
        http.post("/v1/sessions", json={"goal": "x", "agent": "greeter@7.0.0"}), 404, "not_found"
    )
    error_of(http.post("/v1/sessions", json={"goal": "x", "agent": "nobody"}), 404, "not_found")
    error_of(http.post("/v1/agents", json={**ECHO, "version": None}), 400, "invalid_definition")


def test_sessions_are_listed_filtered_and_searched(http: httpx.Client, system: Mesh) -> None:
    marker = f"needle-{time.monotonic_ns()}"
    done_id = start(system.url, f"finished {marker}", ECHO)
    wait_status(system.url, done_id)
    running_id = start(system.url, f"running {marker}", slow_reader(turns=40, delay=0.1))
    try:
        rows = http.get("/v1/sessions", params={"q": marker.upper()}).json()["sessions"]
        assert {r["session_id"] for r in rows} == {done_id, running_id}
        assert rows[0]["session_id"] == running_id  # most recently updated first
        for row in rows:
            assert set(row) >= {
                "session_id",
                "status",
                "goal",
                "last_index",
                "updated_at",
                "side_effects",
            }
        completed = http.get("/v1/sessions", params={"q": marker, "status": "completed"}).json()
        assert [r["session_id"] for r in completed["sessions"]] == [done_id]
        running = http.get("/v1/sessions", params={"q": marker, "status": "running"}).json()
        assert [r["session_id"] for r in running["sessions"]] == [running_id]
        by_id = http.get("/v1/sessions", params={"q": done_id[:12]}).json()["sessions"]
        assert [r["session_id"] for r in by_id] == [done_id]
        assert len(http.get("/v1/sessions", params={"limit": 1}).json()["sessions"]) == 1
        error_of(http.get("/v1/sessions", params={"status": "sleeping"}), 400, "invalid_query")
        error_of(http.get("/v1/sessions", params={"limit": "0"}), 400, "invalid_query")
        error_of(http.get("/v1/sessions", params={"limit": "lots"}), 400, "invalid_query")
    finally:
        http.post(f"/v1/sessions/{running_id}/cancel")


def test_an_unknown_session_is_404_everywhere(http: httpx.Client) -> None:
    unknown = "0123456789abcdef0123456789abcdef"
    error_of(http.get(f"/v1/sessions/{unknown}"), 404, "not_found")
    error_of(http.get(f"/v1/sessions/{unknown}/events"), 404, "not_found")
    error_of(http.post(f"/v1/sessions/{unknown}/hitl/p1", json={"answer": "yes"}), 404, "not_found")
    error_of(http.post(f"/v1/sessions/{unknown}/resume", json={"confirm": True}), 404, "not_found")
    error_of(http.post(f"/v1/sessions/{unknown}/resume"), 404, "not_found")
    error_of(http.post(f"/v1/sessions/{unknown}/cancel"), 404, "not_found")
    error_of(http.get(f"/v1/recoverable/{unknown}"), 404, "not_found")
    # Not even a valid session id: still a 404, never a 5xx.
    error_of(http.get("/v1/sessions/not.a*valid>id"), 404, "not_found")
    error_of(http.get("/v1/sessions/not.a*valid>id/events"), 404, "not_found")


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"goal": 7},
        {"goal": ""},
        {"goal": "   "},
        {"goal": "x", "definition": "not an object"},
        {"goal": "x", "agent": {"name": "echo", "extra": 1}},
        {"goal": "x", "agent": {"version": "1.0.0"}},
        {"goal": "x", "agent": "@1.0.0"},
        {"goal": "x", "agent": "echo@"},
        {"goal": "x", "agent": 3},
        {"goal": "x", "surprise": True},
        {"goal": "x", "agent": "echo", "definition": ECHO},
        ["goal", "x"],
        "goal",
        None,
    ],
)
def test_a_bad_session_body_is_400_invalid_body(http: httpx.Client, body: Any) -> None:
    error_of(http.post("/v1/sessions", json=body), 400, "invalid_body")


def test_malformed_json_and_an_empty_body_are_400(http: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    error_of(http.post("/v1/sessions", content=b"{goal:", headers=headers), 400, "invalid_body")
    error_of(http.post("/v1/sessions", content=b"", headers=headers), 400, "invalid_body")
    error_of(http.post("/v1/sessions", content=b"\xff\xfe", headers=headers), 400, "invalid_body")
    error_of(http.put("/v1/skills/x", content=b"[1,", headers=headers), 400, "invalid_body")
    error_of(http.post("/v1/agents", content=b"nope", headers=headers), 400, "invalid_body")


@pytest.mark.parametrize(
    ("definition", "where"),
    [
        ({"version": "1.0.0"}, "name"),
        ({**ECHO, "coordination": "telepathy"}, "$.coordination"),
        ({**ECHO, "budget": {"max_steps": "many"}}, "$.budget.max_steps"),
        ({**ECHO, "tools": ["fs.teleport"]}, "fs.teleport"),
        ({**ECHO, "model": {"provider": "oracle"}}, "oracle"),
    ],
)
def test_an_invalid_definition_is_400_naming_the_field(
    http: httpx.Client, definition: dict[str, Any], where: str
) -> None:
    for response in (
        http.post("/v1/sessions", json={"goal": "x", "definition": definition}),
        http.post("/v1/agents", json=definition),
    ):
        body = error_of(response, 400, "invalid_definition")
        assert where in body["message"], body


def test_oversize_bodies_and_fields_are_413(http: httpx.Client) -> None:
    huge = "x" * (1024 * 1024 + 1)
    error_of(http.post("/v1/sessions", json={"goal": huge}), 413, "payload_too_large")
    error_of(http.put("/v1/skills/big", json={"body": huge}), 413, "payload_too_large")
    error_of(http.post("/v1/agents", json={**ECHO, "instructions": huge}), 413, "payload_too_large")
    # Under the body limit but over the daemon's own limits for the field.
    long_goal = "g" * (64 * 1024 + 1)
    error_of(
        http.post("/v1/sessions", json={"goal": long_goal, "definition": ECHO}),
        413,
        "payload_too_large",
    )
    long_skill = "s" * (256 * 1024 + 1)
    error_of(http.put("/v1/skills/long", json={"body": long_skill}), 413, "payload_too_large")
    long_definition = {**ECHO, "instructions": "i" * (256 * 1024 + 1)}
    error_of(
        http.post("/v1/sessions", json={"goal": "x", "definition": long_definition}),
        413,
        "payload_too_large",
    )


def test_a_declared_length_over_the_limit_is_413_before_the_body_is_sent(system: Mesh) -> None:
    host, port = system.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10485760\r\n\r\n{"
        )
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]


# --- catalogs -------------------------------------------------------------------------------


def test_skills_are_put_read_listed_and_deleted(http: httpx.Client, system: Mesh) -> None:
    body = "Write plainly. One idea per line."
    put = http.put("/v1/skills/house-style", json={"body": body})
    assert put.status_code == 200, put.text
    skill = put.json()
    assert skill["name"] == "house-style" and skill["body"] == body
    assert skill["digest"] == hashlib.sha256(body.encode()).hexdigest()
    again = http.put("/v1/skills/house-style", json={"body": body + " Always."}).json()
    assert again["revision"] > skill["revision"]
    assert http.get("/v1/skills/house-style").json()["body"] == body + " Always."
    assert "house-style" in {s["name"] for s in http.get("/v1/skills").json()["skills"]}

    # A session that names the skill freezes its body at start.
    with_skill = {**ECHO, "skills": ["house-style"]}
    session_id = start(system.url, "styled", with_skill)
    assert wait_status(system.url, session_id)["status"] == "completed"

    deleted = http.delete("/v1/skills/house-style")
    assert deleted.status_code == 204 and deleted.content == b""
    error_of(http.get("/v1/skills/house-style"), 404, "not_found")
    error_of(http.delete("/v1/skills/house-style"), 404, "not_found")
    missing = error_of(
        http.post("/v1/sessions", json={"goal": "x", "definition": with_skill}),
        400,
        "invalid_definition",
    )
    assert "house-style" in missing["message"]
    error_of(http.put("/v1/skills/bad name!", json={"body": "x"}), 400, "catalog_error")
    error_of(http.put("/v1/skills/x", json={"body": 3}), 400, "invalid_body")
    error_of(http.put("/v1/skills/x", json={"text": "x"}), 400, "invalid_body")


# --- workers, health, metrics ------------------------------------------------------------------


def test_workers_are_listed_with_heartbeats_and_agents(http: httpx.Client, system: Mesh) -> None:
    session_id = start(system.url, "list the workspace", slow_reader(turns=30, delay=0.1))
    try:
        wait_status(system.url, session_id, ("running",))

        def running_somewhere() -> list[dict[str, Any]] | None:
            rows: list[dict[str, Any]] = http.get("/v1/workers").json()["workers"]
            if any(f"{session_id}/root" in w["agents"] for w in rows):
                return rows
            return None

        workers = wait_until(running_somewhere, 30, "the worker reporting the agent it runs")
        assert {w["name"] for w in workers} >= {"w0", "w1"}
        now = time.time()
        for worker in workers:
            assert set(worker) >= {"id", "name", "last_heartbeat", "agents", "alive"}
            assert worker["alive"] is True
            assert now - 10 < worker["last_heartbeat"] <= now + 1
            assert "fs.list" in worker["tools"] and "scripted" in worker["providers"]
        runner = next(w for w in workers if f"{session_id}/root" in w["agents"])
        assert view(system.url, session_id)["agents"][0]["worker"] == runner["id"]
    finally:
        http.post(f"/v1/sessions/{session_id}/cancel")


def test_healthz_answers_ok(http: httpx.Client) -> None:
    response = http.get("/healthz")
    assert response.status_code == 200
    health = response.json()
    assert health["ok"] is True
    assert health["nats"] == "connected"
    host, _, port = health["nats_server"].rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0


SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})? (?P<value>[-+0-9.eE]+|[+-]Inf|NaN)$"
)


def parse_prometheus(text: str) -> dict[str, dict[str, float]]:
    """Samples by metric name and label text, checking the 0.0.4 text format line by line; a
    metric declared without samples yet maps to an empty dict."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            types[name] = kind
            samples.setdefault(name, {})
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        name = match["name"]
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or base in types, f"{name} has no # TYPE line"
        samples.setdefault(name, {})[match["labels"] or ""] = float(match["value"])
    return samples


def test_metrics_count_what_happened_in_prometheus_format(mesh: Mesh) -> None:
    """Sessions by state, agents by phase, appends, heartbeats, a lost worker and the resume it
    caused, journal hits and recoverable sessions, after a fanout whose worker was killed."""
    session_id = start(mesh.url, "write three parts", fanout_writer("metrics"))
    first_effect = wait_event(
        mesh.url,
        session_id,
        lambda e: e["kind"] == "ToolCallRecorded" and "/" in e["event"]["agent"],
    )
    agent = first_effect["event"]["agent"]
    runner = view(mesh.url, session_id)
    worker_id = next(a["worker"] for a in runner["agents"] if a["ref"] == agent)
    names = {w["id"]: w["name"] for w in httpx.get(f"{mesh.url}/v1/workers").json()["workers"]}
    next(w for w in mesh.workers if w.name == names[worker_id]).kill()
    mesh.worker()
    assert wait_status(mesh.url, session_id, timeout=90)["status"] == "completed"

    # The replacement worker may register after the session is done (the other one finished it).
    def two_alive() -> list[dict[str, Any]] | None:
        found: list[dict[str, Any]] = httpx.get(f"{mesh.url}/v1/workers").json()["workers"]
        return found if sum(w["alive"] for w in found) == 2 else None

    workers = wait_until(two_alive, what="two live workers")
    assert [w["alive"] for w in workers if w["id"] == worker_id] == [False]

    response = httpx.get(f"{mesh.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = parse_prometheus(response.text)
    for name in (
        "apomesh_sessions",
        "apomesh_agents",
        "apomesh_events_appended_total",
        "apomesh_append_seconds_bucket",
        "apomesh_append_seconds_sum",
        "apomesh_append_seconds_count",
        "apomesh_heartbeats_received_total",
        "apomesh_workers_alive",
        "apomesh_workers_lost_total",
        "apomesh_resumes_total",
        "apomesh_journal_hits_total",
        "apomesh_recoverable_sessions",
    ):
        assert name in samples, f"{name} missing from /metrics"
    assert samples["apomesh_events_appended_total"]['{kind="SessionStarted"}'] >= 1
    assert samples["apomesh_events_appended_total"]['{kind="AgentResuming"}'] >= 1
    assert samples["apomesh_append_seconds_count"][""] >= 10
    assert (
        samples["apomesh_append_seconds_bucket"]['{le="+Inf"}']
        == (samples["apomesh_append_seconds_count"][""])
    )
    assert samples["apomesh_heartbeats_received_total"][""] > 0
    assert samples["apomesh_workers_lost_total"][""] >= 1
    assert samples["apomesh_workers_alive"][""] == 2
    assert samples["apomesh_resumes_total"]['{path="worker_lost"}'] >= 1
    assert samples["apomesh_recoverable_sessions"][""] == 0
    assert samples["apomesh_sessions"].get('{state="completed"}', 0) >= 0

    # Live state: a running session and its agent show up by state and phase.
    running = start(mesh.url, "read slowly", slow_reader(turns=30, delay=0.1))
    wait_event(mesh.url, running, lambda e: e["kind"] == "AgentSnapshotted")
    live = parse_prometheus(httpx.get(f"{mesh.url}/metrics").text)
    assert live["apomesh_sessions"]['{state="running"}'] == 1
    assert live["apomesh_agents"]['{phase="running"}'] >= 1
    httpx.post(f"{mesh.url}/v1/sessions/{running}/cancel", headers=JSON)


# --- operator actions ---------------------------------------------------------------------------


def test_a_running_session_is_cancelled_once(http: httpx.Client, system: Mesh) -> None:
    session_id = start(system.url, "read for a long time", slow_reader(turns=50, delay=0.1))
    wait_status(system.url, session_id, ("running",))
    response = http.post(f"/v1/sessions/{session_id}/cancel")
    assert response.status_code == 202
    assert response.json() == {"session_id": session_id, "action": "cancel"}
    done = wait_status(system.url, session_id)
    assert done["status"] == "cancelled"
    assert "operator" in (done["reason"] or "")
    error_of(http.post(f"/v1/sessions/{session_id}/cancel", json={}), 409, "apomesh_error")
    error_of(http.post(f"/v1/sessions/{session_id}/cancel", json={"why": 1}), 400, "invalid_body")
    events = http.get(f"/v1/sessions/{session_id}/events").text
    assert "event: OperatorAction" in events and "event: SessionEnded" in events


def test_a_pause_is_answered_once(http: httpx.Client, system: Mesh) -> None:
    session_id = start(system.url, "choose a cover", asker("Blue or red?"))
    paused = wait_status(system.url, session_id, ("paused",))
    (pause,) = paused["hitl_pending"]
    assert pause["agent"] == "root" and pause["question"] == "Blue or red?"
    path = f"/v1/sessions/{session_id}/hitl/{pause['pause_id']}"
    error_of(http.post(path, json={}), 400, "invalid_body")
    error_of(http.post(path, json={"answer": 42}), 400, "invalid_body")
    error_of(
        http.post(f"/v1/sessions/{session_id}/hitl/nope", json={"answer": "x"}), 404, "not_found"
    )
    response = http.post(path, json={"answer": "Blue."})
    assert response.status_code == 202
    assert response.json() == {"session_id": session_id, "action": "answer_hitl"}
    done = wait_status(system.url, session_id)
    assert done["status"] == "completed" and done["hitl_pending"] == []
    error_of(http.post(path, json={"answer": "Red."}), 409, "command_refused")
    answered = wait_event(system.url, session_id, lambda e: e["kind"] == "HitlAnswered")
    assert answered["event"]["answer"] == "Blue." and answered["event"]["by"] == "operator"


def test_resume_needs_the_preview_confirmed_after_a_daemon_restart(mesh: Mesh) -> None:
    """A session with side effects, its daemon SIGKILLed mid-run: after the restart it waits on
    the recoverable list; resuming without confirm answers the preview; with it, it completes and
    no line was appended twice."""
    session_id = start(mesh.url, "append six lines", appender("resume-api.txt"))
    wait_event(
        mesh.url,
        session_id,
        lambda e: e["kind"] == "ToolCallRecorded" and e["event"]["outcome"] == "ok",
    )
    mesh.daemon.kill()
    mesh.daemon.start()

    recoverable = wait_until(
        lambda: httpx.get(f"{mesh.url}/v1/recoverable").json()["sessions"], 30, "the list"
    )
    (row,) = recoverable
    assert row["session_id"] == session_id
    assert row["goal"] == "append six lines"
    assert row["category"] and row["reason"]
    assert row["side_effects"] >= 1
    assert row["last_event_at"] > 0
    stranded = view(mesh.url, session_id)
    assert stranded["status"] == "recoverable" and stranded["reason"] == row["reason"]
    listed = httpx.get(f"{mesh.url}/v1/sessions", params={"status": "recoverable"}).json()
    assert [s["session_id"] for s in listed["sessions"]] == [session_id]

    preview = httpx.get(f"{mesh.url}/v1/recoverable/{session_id}").json()
    assert preview["session_id"] == session_id
    assert isinstance(preview["unknown_outcomes"], list)
    assert preview["pin_diff"] == []
    refused = httpx.post(f"{mesh.url}/v1/sessions/{session_id}/resume", headers=JSON)
    body = error_of(refused, 409, "confirm_required")
    assert body["preview"]["session_id"] == session_id
    assert body["preview"]["reason"] == row["reason"]
    error_of(
        httpx.post(f"{mesh.url}/v1/sessions/{session_id}/resume", json={"confirm": False}),
        409,
        "confirm_required",
    )
    error_of(
        httpx.post(f"{mesh.url}/v1/sessions/{session_id}/resume", json={"confirm": "yes"}),
        400,
        "invalid_body",
    )
    assert view(mesh.url, session_id)["status"] == "recoverable"  # nothing happened

    accepted = httpx.post(f"{mesh.url}/v1/sessions/{session_id}/resume", json={"confirm": True})
    assert accepted.status_code == 202, accepted.text
    assert accepted.json() == {"session_id": session_id, "action": "resume"}
    done = wait_status(mesh.url, session_id, timeout=90)
    assert done["status"] == "completed", done
    assert httpx.get(f"{mesh.url}/v1/recoverable").json()["sessions"] == []
    # No longer stranded: resuming it again, or asking for its preview, is a conflict.
    error_of(
        httpx.post(f"{mesh.url}/v1/sessions/{session_id}/resume", json={"confirm": True}),
        409,
        "apomesh_error",
    )
    error_of(httpx.get(f"{mesh.url}/v1/recoverable/{session_id}"), 409, "apomesh_error")
    error_of(
        httpx.post(f"{mesh.url}/v1/sessions/{session_id}/resume", headers=JSON),
        409,
        "apomesh_error",
    )
    lines = journal_lines(mesh.daemon.workspace / session_id, "resume-api.txt")
    assert len(lines) == len(set(lines)), lines
    assert set(lines) <= {f"line {n}" for n in range(1, 7)}
    assert len(lines) >= 5
    metrics = parse_prometheus(httpx.get(f"{mesh.url}/metrics").text)
    assert metrics["apomesh_resumes_total"]['{path="operator"}'] >= 1
    events = httpx.get(f"{mesh.url}/v1/sessions/{session_id}/events").text
    assert '"action":"resume"' in events and "event: SessionRecovered" in events


@pytest.mark.anyio
async def test_the_preview_shows_a_side_effect_whose_outcome_is_unknown(mesh: Mesh) -> None:
    """A session whose log ends with a side effect's intent and no result (its daemon died in
    between), written straight to the log while the daemon is down: after the boot scan it waits
    on the recoverable list, the preview names the call, and resuming puts it to its probe."""
    from apomesh.adapters.jetstream_log import JetStreamLog
    from apomesh.adapters.nats_connect import connect
    from apomesh.core import envelope
    from apomesh.core.definition import parse_definition
    from apomesh.core.events import AgentLifecycle, SessionStarted, ToolCallIntent
    from apomesh.core.journal import call_key
    from apomesh.plugins.manager import PluginHost
    from apomesh.runtime.composition import compose_shape

    definition = appender("unknown.txt", lines=3, delay=0.1)
    shape = compose_shape(
        parse_definition(definition), host=PluginHost(), skills=[], source="inline"
    )
    args = {"path": "unknown.txt", "line": "line 1"}
    key = call_key("fs.append", args)
    session_id = uuid.uuid4().hex
    events = [
        SessionStarted(goal="append three lines", root="root", shape=shape),
        AgentLifecycle("root", "born", config=shape.root, task="append three lines", task_index=0),
        AgentLifecycle("root", "dispatched", worker="w-gone", epoch=1),
        AgentLifecycle("root", "running", worker="w-gone"),
        ToolCallIntent("root", key, "fs.append", args),
    ]
    await anyio.to_thread.run_sync(mesh.daemon.kill)
    nc = await connect([mesh.nats_url])
    try:
        log = JetStreamLog(nc)
        await log.append(
            session_id,
            [
                envelope.make(session_id, i, time.time(), uuid.uuid4().hex, e)
                for i, e in enumerate(events)
            ],
        )
    finally:
        await nc.close()
    await anyio.to_thread.run_sync(mesh.daemon.start)

    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
        preview = (await http.get(f"/v1/recoverable/{session_id}")).json()
        unknown = [{"agent": "root", "tool": "fs.append", "key": key, "args": args}]
        assert preview["unknown_outcomes"] == unknown
        assert preview["side_effects"] == 1
        state = (await http.get(f"/v1/sessions/{session_id}")).json()
        assert state["status"] == "recoverable" and state["unknown_outcomes"] == unknown
        refused = await http.post(f"/v1/sessions/{session_id}/resume", json={})
        assert refused.status_code == 409
        assert refused.json()["preview"]["unknown_outcomes"] == unknown
        accepted = await http.post(f"/v1/sessions/{session_id}/resume", json={"confirm": True})
        assert accepted.status_code == 202, accepted.text
    done = await anyio.to_thread.run_sync(lambda: wait_status(mesh.url, session_id, timeout=60))
    assert done["status"] == "completed", done
    # The call in doubt was put to fs.append's probe, which found it had not happened: it ran
    # once, logged as a second intent saying so, and every line is there exactly once.
    assert journal_lines(mesh.daemon.workspace / session_id, "unknown.txt") == [
        "line 1",
        "line 2",
        "line 3",
    ]
    events_text = httpx.get(f"{mesh.url}/v1/sessions/{session_id}/events").text
    assert '"resolution":"not_happened"' in events_text


def test_while_nats_is_down_health_is_503_and_reads_are_503_not_500(mesh: Mesh) -> None:
    session_id = start(mesh.url, "before the outage", ECHO)
    assert wait_status(mesh.url, session_id)["status"] == "completed"
    unknown = uuid.uuid4().hex
    mesh.server.kill()
    try:
        health = wait_until(
            lambda: (r := httpx.get(f"{mesh.url}/healthz", timeout=10)).status_code == 503 and r,
            30,
            "the daemon noticing NATS is gone",
        )
        assert health.json()["ok"] is False
        # What needs the log cannot be answered now (after the log's own retry timeout): a
        # retryable 503, never a 500.
        response = httpx.get(f"{mesh.url}/v1/sessions/{unknown}", timeout=30)
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "log_unavailable"
        # An ended session the daemon already folded is still answered from its cache.
        assert view(mesh.url, session_id)["status"] == "completed"
    finally:
        mesh.server.start()
    wait_until(
        lambda: httpx.get(f"{mesh.url}/healthz", timeout=10).status_code == 200, 60, "recovery"
    )
    after = start(mesh.url, "after the outage", ECHO)
    assert wait_status(mesh.url, after)["status"] == "completed"
