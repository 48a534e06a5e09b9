"""The HTTP API against the in-memory fake daemon: every endpoint's statuses and bodies, bad bodies
(never a 5xx), auth (roles, 401, 403, 429), the OpenAPI document, and the SSE stream on a real
uvicorn server (ids, Last-Event-ID, keep-alive, the end after the terminal event)."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Mount, Route
from tests.fakes.fake_service import FakeService, serving

from apomesh.api.app import close_event_streams, create_app
from apomesh.api.auth import Authenticator, AuthFailure, AuthSettings
from apomesh.api.openapi import ROUTES, openapi_document
from apomesh.api.tokens import TokenStore
from apomesh.core.errors import (
    ApomeshError,
    DefinitionError,
    Fenced,
    LogUnavailable,
    NotFound,
    PayloadTooLarge,
    PinError,
    PublishConflict,
    StoreFull,
)
from apomesh.core.events import AgentResumed, AgentResuming, CoordinatorCheckpoint
from apomesh.core.views import PinDiff

WRITER = {"name": "writer", "version": "1.0.0", "instructions": "Write."}


class AppClient:
    """A blocking client of an ASGI app in memory (httpx's ASGI transport). The app, the fake
    service and this client share one event loop, run by a portal in a background thread."""

    def __init__(self, portal: BlockingPortal, app: Starlette) -> None:
        self.portal = portal
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 50000))
        self.http = httpx.AsyncClient(transport=transport, base_url="http://testserver")

    def __enter__(self) -> AppClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.portal.call(self.http.aclose)

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        if method != "GET":
            # As the SDK does: the API refuses a write that is not JSON (415).
            kwargs["headers"] = {"Content-Type": "application/json", **kwargs.get("headers", {})}
        return self.portal.call(partial(self.http.request, method, url, **kwargs))

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def put(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("PUT", url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", url, **kwargs)


Api = Callable[[Starlette], AppClient]
Run = Callable[..., Any]


@pytest.fixture
def portal() -> Iterator[BlockingPortal]:
    with start_blocking_portal(backend="asyncio") as running:
        yield running


@pytest.fixture
def fake() -> FakeService:
    return FakeService()


@pytest.fixture
def run(portal: BlockingPortal) -> Run:
    """Drive a fake-service coroutine from a sync test, on the app's loop."""

    def call(work: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        return portal.call(partial(work, *args, **kwargs))

    return call


@pytest.fixture
def api(portal: BlockingPortal) -> Api:
    return lambda app: AppClient(portal, app)


@pytest.fixture
def client(fake: FakeService, api: Api) -> AppClient:
    return api(create_app(fake, auth=AuthSettings.off()))


def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) >= {"error", "message"}
    assert isinstance(body["message"], str)
    return str(body["error"])


# --- the route table, the app and the document agree ---------------------------------------------


def app_routes(app: Any) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for route in app.routes:
        if isinstance(route, Mount):
            found.add(("GET", f"{route.path}/{{path}}"))
        elif isinstance(route, Route):
            # A greedy parameter (``{ref:path}``, a ref may hold ``/``) is documented as ``{ref}``.
            path = re.sub(r"\{(\w+):path\}", r"{\1}", route.path)
            found |= {(m, path) for m in (route.methods or set()) if m != "HEAD"}
    return found


def test_every_route_is_documented_and_every_documented_route_exists(fake: FakeService) -> None:
    app = create_app(fake, auth=AuthSettings.off())
    document = openapi_document()
    documented = {(m.upper(), path) for path, ops in document["paths"].items() for m in ops}
    assert app_routes(app) == documented
    assert {(r.method, r.path) for r in ROUTES} == documented
    design = {
        ("POST", "/v1/sessions"), ("GET", "/v1/sessions"), ("GET", "/v1/sessions/{session_id}"),
        ("GET", "/v1/sessions/{session_id}/events"),
        ("POST", "/v1/sessions/{session_id}/hitl/{pause_id}"),
        ("POST", "/v1/sessions/{session_id}/resume"), ("POST", "/v1/sessions/{session_id}/cancel"),
        ("GET", "/v1/recoverable"), ("GET", "/v1/workers"), ("PUT", "/v1/skills/{name}"),
        ("GET", "/v1/skills/{name}"), ("DELETE", "/v1/skills/{name}"), ("GET", "/v1/skills"),
        ("POST", "/v1/agents"), ("GET", "/v1/agents"), ("GET", "/healthz"), ("GET", "/metrics"),
        ("GET", "/"),
    }  # fmt: skip
    assert design <= documented


def test_the_openapi_document_is_served_with_schemas_from_the_structs(client: AppClient) -> None:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.1")
    schemas = document["components"]["schemas"]
    assert {"SessionView", "CreateSessionBody", "ErrorBody", "RecoverableView"} <= set(schemas)
    assert "goal" in schemas["CreateSessionBody"]["required"]
    create = document["paths"]["/v1/sessions"]["post"]
    assert create["x-apomesh-role"] == "operator"
    assert {"201", "400", "401", "403", "429", "500"} <= set(create["responses"])
    assert "security" not in document["paths"]["/healthz"]["get"]
    events = document["paths"]["/v1/sessions/{session_id}/events"]["get"]
    assert "text/event-stream" in events["responses"]["200"]["content"]


# --- sessions ------------------------------------------------------------------------------------


def test_a_session_starts_from_an_inline_definition(client: AppClient, fake: FakeService) -> None:
    response = client.post("/v1/sessions", json={"goal": "write", "definition": WRITER})
    assert response.status_code == 201
    session_id = response.json()["session_id"]
    assert fake.calls[-1] == ("create_session", "write", None, WRITER, "operator")
    view = client.get(f"/v1/sessions/{session_id}").json()
    assert (view["session_id"], view["status"], view["goal"]) == (session_id, "running", "write")
    assert [a["ref"] for a in view["agents"]] == ["root"]
    assert set(view) >= {"output", "side_effects", "last_index", "hitl_pending", "unknown_outcomes"}


def test_a_session_starts_from_a_published_agent_by_object_or_string(
    client: AppClient, fake: FakeService
) -> None:
    assert client.post("/v1/agents", json=WRITER).status_code == 201
    assert client.post("/v1/agents", json={**WRITER, "version": "1.1.0"}).status_code == 201
    by_object = client.post("/v1/sessions", json={"goal": "g", "agent": {"name": "writer"}})
    assert by_object.status_code == 201
    assert fake.calls[-1][2] == ("writer", None)
    by_string = client.post("/v1/sessions", json={"goal": "g", "agent": "writer@1.0.0"})
    assert by_string.status_code == 201
    assert fake.calls[-1][2] == ("writer", "1.0.0")
    unknown = client.post("/v1/sessions", json={"goal": "g", "agent": {"name": "nobody"}})
    assert unknown.status_code == 404 and error_of(unknown) == "not_found"


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"goal": 3},
        {"goal": "  "},
        {"goal": "g", "colour": "blue"},
        {"goal": "g", "agent": {"name": "writer"}, "definition": WRITER},
        {"goal": "g", "agent": {"version": "1"}},
        {"goal": "g", "agent": "@1.0"},
        {"goal": "g", "agent": "writer@"},
        {"goal": "g", "definition": "not a table"},
        [1, 2],
    ],
)
def test_a_bad_session_body_is_400_invalid_body(client: AppClient, body: Any) -> None:
    response = client.post("/v1/sessions", json=body)
    assert response.status_code == 400
    assert error_of(response) == "invalid_body"


def test_broken_json_and_an_empty_body_are_400(client: AppClient) -> None:
    for content in (b"{bad", b"", b"\xff\xfe", b'{"goal": "g"} trailing'):
        response = client.post("/v1/sessions", content=content)
        assert response.status_code == 400, content
        assert error_of(response) == "invalid_body"


def test_an_invalid_definition_is_400_invalid_definition(client: AppClient) -> None:
    response = client.post(
        "/v1/sessions",
        json={"goal": "g", "definition": {"name": "w", "budget": {"max_steps": "x"}}},
    )
    assert response.status_code == 400
    assert error_of(response) == "invalid_definition"
    assert "max_steps" in response.json()["message"]


def test_sessions_are_listed_filtered_and_searched(
    client: AppClient, fake: FakeService, run: Run
) -> None:
    first = run(fake.start, "write a haiku")
    second = run(fake.start, "summarise the minutes")
    run(fake.end, second)
    stranded = run(fake.start, "send the invoices")
    fake.make_recoverable(stranded)

    def ids(**params: Any) -> list[str]:
        response = client.get("/v1/sessions", params=params)
        assert response.status_code == 200
        return [s["session_id"] for s in response.json()["sessions"]]

    assert set(ids()) == {first, second, stranded}
    assert ids(status="completed") == [second]
    assert ids(status="recoverable") == [stranded]
    assert ids(q="HAIKU") == [first]
    assert ids(q=second[3:9]) == [second]
    assert len(ids(limit=1)) == 1
    for bad in ({"status": "sleeping"}, {"limit": "0"}, {"limit": "lots"}, {"limit": "5000"}):
        response = client.get("/v1/sessions", params=bad)
        assert response.status_code == 400 and error_of(response) == "invalid_query"


def test_an_unknown_session_is_404_everywhere(client: AppClient) -> None:
    for method, path, body in [
        ("GET", "/v1/sessions/nope", None),
        ("GET", "/v1/sessions/nope/events", None),
        ("POST", "/v1/sessions/nope/hitl/p1", {"answer": "yes"}),
        ("POST", "/v1/sessions/nope/resume", {"confirm": True}),
        ("POST", "/v1/sessions/nope/cancel", {}),
        ("GET", "/v1/recoverable/nope", None),
    ]:
        response = client.request(method, path, json=body)
        assert response.status_code == 404, path
        assert error_of(response) == "not_found"


def test_unknown_paths_and_methods_answer_json(client: AppClient) -> None:
    missing = client.get("/v1/nothing-here")
    assert missing.status_code == 404 and error_of(missing) == "not_found"
    wrong = client.delete("/v1/sessions")
    assert wrong.status_code == 405 and error_of(wrong) == "method_not_allowed"


# --- operator actions ----------------------------------------------------------------------------


def test_a_pause_is_answered_once(client: AppClient, fake: FakeService, run: Run) -> None:
    session_id = run(fake.start)
    pause_id = run(fake.pause, session_id, "root", "Which tone?")
    view = client.get(f"/v1/sessions/{session_id}").json()
    assert view["status"] == "paused"
    assert view["hitl_pending"] == [
        {"pause_id": pause_id, "agent": "root", "question": "Which tone?"}
    ]
    path = f"/v1/sessions/{session_id}/hitl/{pause_id}"
    assert client.post(path, json={"answer": 7}).status_code == 400
    assert client.post(path, json={"answer": "dry", "extra": 1}).status_code == 400
    response = client.post(path, json={"answer": "dry"})
    assert response.status_code == 202
    assert response.json() == {"session_id": session_id, "action": "answer_hitl"}
    assert fake.calls[-1] == ("answer_hitl", session_id, pause_id, "dry", "operator")
    assert client.get(f"/v1/sessions/{session_id}").json()["status"] == "running"
    again = client.post(path, json={"answer": "dry"})
    assert again.status_code == 409 and error_of(again) == "command_refused"


def test_resume_needs_confirmation_after_the_preview(
    client: AppClient, fake: FakeService, run: Run
) -> None:
    session_id = run(fake.start, "send invoices")
    run(
        fake.side_effect,
        session_id,
        "root",
        "fs.append",
        {"path": "out", "line": "x"},
        recorded=False,
    )
    fake.make_recoverable(
        session_id, pin_diff=[PinDiff(name="apomesh-extra", old="1.0", new="1.2")]
    )
    listed = client.get("/v1/recoverable").json()["sessions"]
    assert [r["session_id"] for r in listed] == [session_id]
    preview = client.get(f"/v1/recoverable/{session_id}").json()
    assert preview["unknown_outcomes"][0]["tool"] == "fs.append"
    assert preview["pin_diff"] == [{"name": "apomesh-extra", "old": "1.0", "new": "1.2"}]

    for body in (None, {}, {"confirm": False}):
        refused = client.post(f"/v1/sessions/{session_id}/resume", json=body)
        assert refused.status_code == 409
        assert error_of(refused) == "confirm_required"
        assert refused.json()["preview"] == preview
    assert not any(call[0] == "resume" for call in fake.calls)

    stale_pins = client.post(f"/v1/sessions/{session_id}/resume", json={"confirm": True})
    assert stale_pins.status_code == 409 and error_of(stale_pins) == "plugin_pin_mismatch"
    bad = client.post(f"/v1/sessions/{session_id}/resume", json={"confirm": "yes"})
    assert bad.status_code == 400
    resumed = client.post(
        f"/v1/sessions/{session_id}/resume",
        json={"confirm": True, "migrate_pins": {"apomesh-extra": "1.2"}},
    )
    assert resumed.status_code == 202
    assert resumed.json() == {"session_id": session_id, "action": "resume"}
    assert fake.calls[-1] == ("resume", session_id, {"apomesh-extra": "1.2"}, "operator")
    assert client.get("/v1/recoverable").json()["sessions"] == []
    not_recoverable = client.post(f"/v1/sessions/{session_id}/resume", json={"confirm": True})
    assert not_recoverable.status_code == 409
    assert client.get(f"/v1/recoverable/{session_id}").status_code == 409


def test_cancel_accepts_an_empty_body_and_refuses_an_ended_session(
    client: AppClient, fake: FakeService, run: Run
) -> None:
    session_id = run(fake.start)
    response = client.post(f"/v1/sessions/{session_id}/cancel")
    assert response.status_code == 202
    assert response.json() == {"session_id": session_id, "action": "cancel"}
    view = client.get(f"/v1/sessions/{session_id}").json()
    assert (view["status"], view["reason"]) == ("cancelled", "cancelled by operator")
    again = client.post(f"/v1/sessions/{session_id}/cancel", json={})
    assert again.status_code == 409 and error_of(again) == "apomesh_error"
    other = run(fake.start)
    assert client.post(f"/v1/sessions/{other}/cancel", json={"why": 1}).status_code == 400


def test_workers_are_listed(client: AppClient, fake: FakeService) -> None:
    fake.add_worker("w1", "edge-1", ["s1/root"], last_heartbeat=1000.0)
    fake.add_worker("w2", "edge-2", [], alive=False, last_heartbeat=900.0)
    workers = client.get("/v1/workers").json()["workers"]
    assert [
        (w["id"], w["name"], w["alive"], w["last_heartbeat"], w["agents"]) for w in workers
    ] == [
        ("w1", "edge-1", True, 1000.0, ["s1/root"]),
        ("w2", "edge-2", False, 900.0, []),
    ]


def test_daemons_are_listed_and_one_is_drained(client: AppClient, fake: FakeService) -> None:
    [row] = client.get("/v1/daemons").json()["daemons"]
    assert (row["id"], row["state"], row["this"]) == ("d-this", "active", True)
    assert {"host", "url", "sessions", "stranded", "load", "lease_age"} <= set(row)
    response = client.post("/v1/daemons/d-this/drain", json={})
    assert response.status_code == 202
    assert response.json() == {"daemon_id": "d-this", "action": "drain"}
    assert client.get("/v1/daemons").json()["daemons"][0]["state"] == "drained"
    missing = client.post("/v1/daemons/nobody/drain", json={})
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"


# --- catalog -------------------------------------------------------------------------------------


def test_skills_are_put_read_listed_and_deleted(client: AppClient) -> None:
    put = client.put("/v1/skills/house-style", json={"body": "Be brief."})
    assert put.status_code == 200
    assert (put.json()["name"], put.json()["revision"]) == ("house-style", 1)
    assert (
        client.put("/v1/skills/house-style", json={"body": "Be briefer."}).json()["revision"] == 2
    )
    assert client.get("/v1/skills/house-style").json()["body"] == "Be briefer."
    assert [s["name"] for s in client.get("/v1/skills").json()["skills"]] == ["house-style"]
    assert client.delete("/v1/skills/house-style").status_code == 204
    missing = client.get("/v1/skills/house-style")
    assert missing.status_code == 404 and error_of(missing) == "not_found"
    assert client.delete("/v1/skills/house-style").status_code == 404
    assert client.put("/v1/skills/x", json={"text": "wrong field"}).status_code == 400
    bad_name = client.put("/v1/skills/-bad", json={"body": "b"})
    assert bad_name.status_code == 400 and error_of(bad_name) == "catalog_error"


def test_a_skill_over_the_service_limit_is_413(fake: FakeService, api: Api) -> None:
    fake.max_skill_bytes = 10
    with api(create_app(fake, auth=AuthSettings.off())) as client:
        response = client.put("/v1/skills/big", json={"body": "x" * 11})
    assert response.status_code == 413 and error_of(response) == "payload_too_large"


def test_agents_publish_create_only(client: AppClient) -> None:
    created = client.post("/v1/agents", json=WRITER)
    assert created.status_code == 201
    record = created.json()
    assert (record["name"], record["version"], record["definition"]) == ("writer", "1.0.0", WRITER)
    same = client.post("/v1/agents", json=WRITER)
    assert same.status_code == 200 and same.json() == record
    other = client.post("/v1/agents", json={**WRITER, "instructions": "Shout."})
    assert other.status_code == 409 and error_of(other) == "publish_conflict"
    no_version = client.post("/v1/agents", json={"name": "writer"})
    assert no_version.status_code == 400 and error_of(no_version) == "invalid_definition"
    assert client.post("/v1/agents", json=["writer"]).status_code == 400
    client.post("/v1/agents", json={**WRITER, "version": "1.10.0"})
    client.post("/v1/agents", json={**WRITER, "version": "1.9.0"})
    assert [a["version"] for a in client.get("/v1/agents").json()["agents"]] == [
        "1.0.0",
        "1.9.0",
        "1.10.0",
    ]
    assert client.get("/v1/agents/writer").json()["version"] == "1.10.0"
    assert client.get("/v1/agents/writer", params={"version": "1.9.0"}).json()["version"] == "1.9.0"
    assert client.get("/v1/agents/writer", params={"version": "2"}).status_code == 404
    assert client.get("/v1/agents/nobody").status_code == 404


# --- operations, console -------------------------------------------------------------------------


def test_health_metrics_and_the_console(client: AppClient, fake: FakeService, run: Run) -> None:
    run(fake.start)
    health = client.get("/healthz")
    assert health.status_code == 200 and health.json() == {"ok": True, "sessions": 1}
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'apomesh_sessions{state="running"} 1' in metrics.text
    assert "# TYPE apomesh_append_seconds histogram" in metrics.text
    console = client.get("/")
    assert console.status_code == 200
    assert console.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in console.headers["content-security-policy"]
    assert '<script type="module" src="/static/app.js">' in console.text
    script = client.get("/static/app.js")
    assert script.status_code == 200 and "followEvents" in script.text
    assert client.get("/static/app.css").status_code == 200
    assert client.get("/static/nothing.js").status_code == 404


def test_an_unhealthy_daemon_answers_503(fake: FakeService, api: Api) -> None:
    async def sick() -> dict[str, Any]:
        return {"ok": False, "nats": "down"}

    fake.health = sick  # type: ignore[method-assign]
    with api(create_app(fake, auth=AuthSettings.off())) as client:
        assert client.get("/healthz").status_code == 503
        del fake.health  # back to the class's method
        fake.broken = RuntimeError("boom")
        assert client.get("/healthz").status_code == 503


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (NotFound("session s"), 404, "not_found"),
        (DefinitionError("bad", where="x"), 400, "invalid_definition"),
        (PublishConflict("taken"), 409, "publish_conflict"),
        (PayloadTooLarge("goal", 10, 5), 413, "payload_too_large"),
        (PinError("gone", pin="p"), 409, "pin_error"),
        (Fenced("stale"), 409, "fenced"),
        (LogUnavailable("nats down"), 503, "log_unavailable"),
        (StoreFull("full"), 503, "store_full"),
        (ApomeshError("not now"), 409, "apomesh_error"),
    ],
)
def test_typed_service_errors_map_to_statuses(
    api: Api, fake: FakeService, error: ApomeshError, status: int, code: str
) -> None:
    with api(create_app(fake, auth=AuthSettings.off())) as client:
        fake.broken = error
        response = client.get("/v1/sessions")
    assert response.status_code == status
    assert response.json() == {"error": code, "message": error.message}


def test_an_unexpected_error_is_a_logged_generic_500(
    api: Api, fake: FakeService, caplog: pytest.LogCaptureFixture
) -> None:
    with api(create_app(fake, auth=AuthSettings.off())) as client:
        fake.broken = RuntimeError("secret internals")
        with caplog.at_level(logging.ERROR, logger="apomesh.api"):
            response = client.get("/v1/workers")
    assert response.status_code == 500
    assert response.json() == {"error": "internal", "message": "internal server error"}
    assert "secret internals" not in response.text
    assert any("GET /v1/workers" in r.getMessage() for r in caplog.records)


def test_a_raw_body_over_the_limit_is_413_before_parsing(fake: FakeService, api: Api) -> None:
    app = create_app(fake, auth=AuthSettings.off(), max_body_bytes=100)
    with api(app) as client:
        big = json.dumps({"goal": "g" * 200}).encode()
        declared = client.post("/v1/sessions", content=big)
        assert declared.status_code == 413 and error_of(declared) == "payload_too_large"

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"goal": "'
            for _ in range(20):
                yield b"g" * 10
            yield b'"}'

        streamed = client.post("/v1/sessions", content=chunks())
        assert streamed.status_code == 413
        assert client.post("/v1/sessions", json={"goal": "fits"}).status_code == 201
    assert not any(call[0] == "create_session" and call[1] != "fits" for call in fake.calls)


# --- no bad body ever gets a 5xx -----------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
near_valid = st.fixed_dictionaries(
    {},
    optional={
        "goal": json_values,
        "agent": json_values,
        "definition": json_values,
        "answer": json_values,
        "migrate_pins": json_values,
        "confirm": json_values,
        "body": json_values,
        "name": json_values,
        "version": json_values,
        "model": json_values,
        "budget": json_values,
        "roles": json_values,
    },
)
bodies = st.one_of(
    st.binary(max_size=64),
    json_values.map(lambda v: json.dumps(v).encode()),
    near_valid.map(lambda v: json.dumps(v).encode()),
)


def test_random_bodies_never_get_a_5xx(api: Api, run: Run) -> None:
    fake = FakeService()
    session_id = run(fake.start)
    pause_id = run(fake.pause, session_id, "root", "ok?")
    stranded = run(fake.start)
    fake.make_recoverable(stranded)
    targets = [
        ("POST", "/v1/sessions"),
        ("POST", f"/v1/sessions/{session_id}/hitl/{pause_id}"),
        ("POST", f"/v1/sessions/{stranded}/resume"),
        ("POST", f"/v1/sessions/{session_id}/cancel"),
        ("PUT", "/v1/skills/style"),
        ("POST", "/v1/agents"),
    ]
    with api(create_app(fake, auth=AuthSettings.off())) as client:

        @settings(
            max_examples=150,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )
        @given(target=st.sampled_from(targets), body=bodies)
        def check(target: tuple[str, str], body: bytes) -> None:
            response = client.request(target[0], target[1], content=body)
            assert response.status_code < 500, (target, body, response.text)
            if response.status_code >= 400:
                error_of(response)

        check()


# --- auth ----------------------------------------------------------------------------------------


@pytest.fixture
def tokens(tmp_path: Path) -> TokenStore:
    return TokenStore.in_dir(tmp_path)


def test_tokens_are_stored_hashed_in_a_private_file(tokens: TokenStore) -> None:
    token_id, secret = tokens.create("read", "dashboard")
    assert secret.startswith(f"apm_{token_id}_")
    raw = tokens.path.read_text()
    assert secret not in raw and secret.split("_", 2)[2] not in raw
    assert stat.S_IMODE(os.stat(tokens.path).st_mode) == 0o600
    assert tokens.verify(secret) == "read"
    assert tokens.verify(secret + "x") is None
    assert tokens.verify(f"apm_{token_id}_wrong") is None
    assert tokens.verify("garbage") is None
    assert [(t.id, t.name, t.role) for t in tokens.list()] == [(token_id, "dashboard", "read")]
    # Another process (the command line) revokes it: the running store sees the file change.
    assert TokenStore(tokens.path).revoke(token_id) is True
    assert tokens.verify(secret) is None
    assert tokens.revoke(token_id) is False
    with pytest.raises(ValueError):
        tokens.create("admin", "x")


def test_auth_on_needs_a_token_store() -> None:
    with pytest.raises(ValueError):
        AuthSettings(enabled=True)


def test_roles_decide_what_a_token_may_do(
    fake: FakeService, tokens: TokenStore, api: Api, run: Run
) -> None:
    _, reader = tokens.create("read", "dashboard")
    _, operator = tokens.create("operator", "alice")
    session_id = run(fake.start)
    pause_id = run(fake.pause, session_id, "root", "ok?")
    app = create_app(fake, auth=AuthSettings(enabled=True, token_store=tokens))
    with api(app) as client:
        anonymous = client.get("/v1/sessions")
        assert anonymous.status_code == 401 and error_of(anonymous) == "unauthorized"
        assert anonymous.headers["www-authenticate"] == "Bearer"
        as_reader = {"Authorization": f"Bearer {reader}"}
        as_operator = {"Authorization": f"Bearer {operator}"}
        for path in ("/v1/sessions", f"/v1/sessions/{session_id}", "/v1/recoverable",
                     "/v1/workers", "/v1/skills", "/v1/agents", "/metrics"):  # fmt: skip
            assert client.get(path, headers=as_reader).status_code == 200, path
        writes = [
            ("POST", "/v1/sessions", {"goal": "g"}),
            ("POST", f"/v1/sessions/{session_id}/hitl/{pause_id}", {"answer": "yes"}),
            ("POST", f"/v1/sessions/{session_id}/cancel", {}),
            ("POST", f"/v1/sessions/{session_id}/resume", {"confirm": True}),
            ("PUT", "/v1/skills/style", {"body": "b"}),
            ("DELETE", "/v1/skills/style", None),
            ("POST", "/v1/agents", WRITER),
        ]
        for method, path, body in writes:
            refused = client.request(method, path, json=body, headers=as_reader)
            assert refused.status_code == 403 and error_of(refused) == "forbidden", path
        answered = client.post(
            f"/v1/sessions/{session_id}/hitl/{pause_id}",
            json={"answer": "yes"},
            headers=as_operator,
        )
        assert answered.status_code == 202
        assert fake.calls[-1][-1] == "alice"  # operator actions name the token
        assert client.get("/v1/sessions", headers={"Authorization": "Basic abc"}).status_code == 401
        for open_path in ("/healthz", "/", "/openapi.json", "/static/app.js"):
            assert client.get(open_path).status_code == 200, open_path


def test_failed_logins_are_logged_without_the_token_and_rate_limited(
    api: Api, fake: FakeService, tokens: TokenStore, caplog: pytest.LogCaptureFixture
) -> None:
    _, good = tokens.create("operator", "alice")
    app = create_app(fake, auth=AuthSettings(enabled=True, token_store=tokens, max_failures=3))
    with api(app) as client, caplog.at_level(logging.WARNING, logger="apomesh.api.auth"):
        guesses = [f"apm_guess{i}_secret-guess-{i}" for i in range(3)]
        for guess in guesses:
            response = client.get("/v1/sessions", headers={"Authorization": f"Bearer {guess}"})
            assert response.status_code == 401
        limited = client.get("/v1/sessions", headers={"Authorization": "Bearer apm_x_y"})
        assert limited.status_code == 429 and error_of(limited) == "too_many_requests"
        assert int(limited.headers["retry-after"]) >= 1
        # Failures are limited, not successes: the valid token still works from that address.
        valid = client.get("/v1/sessions", headers={"Authorization": f"Bearer {good}"})
        assert valid.status_code == 200
        assert client.get("/healthz").status_code == 200
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "authentication failed" in logged
    assert not any(guess in logged or guess.split("_")[2] in logged for guess in guesses)
    assert good not in logged


def test_failures_age_out_of_the_window(tokens: TokenStore) -> None:
    now = [0.0]
    authenticator = Authenticator(
        AuthSettings(enabled=True, token_store=tokens, max_failures=2, failure_window=60.0),
        clock=lambda: now[0],
    )
    _, good = tokens.create("read", "r")
    for _ in range(2):
        with pytest.raises(AuthFailure) as failure:
            authenticator.check("10.0.0.9", "Bearer nope", "read")
        assert failure.value.status == 401
    with pytest.raises(AuthFailure) as limited:
        authenticator.check("10.0.0.9", "Bearer nope", "read")
    assert limited.value.status == 429
    assert authenticator.check("10.0.0.9", f"Bearer {good}", "read").role == "read"
    now[0] = 61.0
    with pytest.raises(AuthFailure) as again:
        authenticator.check("10.0.0.9", "Bearer nope", "read")
    assert again.value.status == 401


# --- server-sent events on a real server ---------------------------------------------------------


def parse_frames(text: str) -> list[dict[str, str]]:
    frames = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(":")
            fields[name or "comment"] = value[1:] if value.startswith(" ") else value
        frames.append(fields)
    return frames


async def read_stream(client: httpx.AsyncClient, url: str, **kwargs: Any) -> tuple[int, str]:
    with anyio.fail_after(20):
        async with client.stream("GET", url, **kwargs) as response:
            text = (await response.aread()).decode()
            return response.status_code, text


@pytest.mark.anyio
async def test_the_stream_replays_the_log_and_ends_after_the_terminal_event() -> None:
    fake = FakeService()
    session_id = await fake.start()
    await fake.emit(session_id, CoordinatorCheckpoint(position="plan", state=b"\x00\x01\xff"))
    last = await fake.end(session_id, output="a haiku")
    app = create_app(fake, auth=AuthSettings.off())
    async with serving(app) as url, httpx.AsyncClient(base_url=url) as client:
        status, text = await read_stream(client, f"/v1/sessions/{session_id}/events")
    assert status == 200
    frames = [f for f in parse_frames(text) if "id" in f]
    assert [int(f["id"]) for f in frames] == list(range(last + 1))
    assert [f["event"] for f in frames] == [
        "SessionStarted", "AgentLifecycle", "AgentLifecycle", "CoordinatorCheckpoint", "SessionEnded",
    ]  # fmt: skip
    envelope = json.loads(frames[3]["data"])
    assert set(envelope) == {"v", "session_id", "index", "ts", "event_id", "kind", "event"}
    assert (envelope["session_id"], envelope["index"], envelope["kind"]) == (
        session_id, 3, "CoordinatorCheckpoint",
    )  # fmt: skip
    assert base64.b64decode(envelope["event"]["state"]) == b"\x00\x01\xff"
    assert json.loads(frames[4]["data"])["event"]["output"] == "a haiku"


@pytest.mark.anyio
async def test_last_event_id_resumes_exactly_after_it() -> None:
    fake = FakeService()
    session_id = await fake.start()
    for i in range(4):
        await fake.spawn(session_id, f"root/{i}", "root", f"part {i}")
    last = await fake.end(session_id)
    app = create_app(fake, auth=AuthSettings.off())
    path = f"/v1/sessions/{session_id}/events"
    async with serving(app) as url, httpx.AsyncClient(base_url=url) as client:

        async def ids(**kwargs: Any) -> list[int]:
            status, text = await read_stream(client, path, **kwargs)
            assert status == 200
            return [int(f["id"]) for f in parse_frames(text) if "id" in f]

        assert await ids(headers={"Last-Event-ID": "4"}) == list(range(5, last + 1))
        assert await ids(params={"after": "2"}) == list(range(3, last + 1))
        assert await ids(headers={"Last-Event-ID": "5"}, params={"after": "0"}) == list(
            range(6, last + 1)
        )
        # Nothing after the terminal event: the stream ends at once instead of waiting.
        assert await ids(headers={"Last-Event-ID": str(last)}) == []
        for bad in ({"headers": {"Last-Event-ID": "x"}}, {"params": {"after": "-5"}}):
            response = await client.get(path, **bad)  # type: ignore[arg-type]
            assert response.status_code == 400 and error_of(response) == "invalid_query"
        missing = await client.get("/v1/sessions/nobody/events")
        assert missing.status_code == 404
        assert missing.headers["content-type"].startswith("application/json")


@pytest.mark.anyio
async def test_a_live_stream_follows_new_events_with_keep_alives_until_the_end() -> None:
    fake = FakeService()
    session_id = await fake.start()
    app = create_app(fake, auth=AuthSettings.off(), keepalive_seconds=0.05)
    seen: list[str] = []
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, timeout=20) as client,
        client.stream("GET", f"/v1/sessions/{session_id}/events") as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.aiter_lines()
        with anyio.fail_after(20):
            # The replay first, then keep-alives while the session is idle.
            while ": keep-alive" not in seen:
                seen.append(await anext(lines))
            await fake.spawn(session_id, "root/0", "root", "intro")
            await fake.emit(
                session_id,
                AgentResuming(agent="root/0", reason="worker lost", epoch=2),
                AgentResumed(agent="root/0", epoch=2),
            )
            await fake.end(session_id)
            async for line in lines:
                seen.append(line)
    events = [line.removeprefix("event: ") for line in seen if line.startswith("event: ")]
    assert events == [
        "SessionStarted", "AgentLifecycle", "AgentLifecycle",
        "AgentLifecycle", "AgentResuming", "AgentResumed", "SessionEnded",
    ]  # fmt: skip
    ids = [int(line.removeprefix("id: ")) for line in seen if line.startswith("id: ")]
    assert ids == list(range(7))


@pytest.mark.anyio
async def test_a_stopping_server_ends_open_streams_cleanly() -> None:
    fake = FakeService()
    session_id = await fake.start()
    app = create_app(fake, auth=AuthSettings.off())
    received: list[str] = []
    async with httpx.AsyncClient(timeout=20) as client, serving(app) as url:
        async with client.stream("GET", f"{url}/v1/sessions/{session_id}/events") as response:
            lines = response.aiter_lines()
            with anyio.fail_after(20):
                while len([x for x in received if x.startswith("id: ")]) < 3:
                    received.append(await anext(lines))
                close_event_streams(app)
                async for line in lines:
                    received.append(line)
        # A stream opened while closing ends at once, too.
        status, text = await read_stream(client, f"{url}/v1/sessions/{session_id}/events")
        assert status == 200 and "SessionEnded" not in text
    assert [x for x in received if x.startswith("id: ")] == ["id: 0", "id: 1", "id: 2"]
    assert len(app.state.event_streams) == 0


@pytest.mark.anyio
async def test_a_client_that_leaves_releases_its_stream() -> None:
    fake = FakeService()
    session_id = await fake.start()
    app = create_app(fake, auth=AuthSettings.off())
    async with serving(app) as url:
        async with (
            httpx.AsyncClient(base_url=url) as client,
            client.stream("GET", f"/v1/sessions/{session_id}/events") as response,
        ):
            await anext(response.aiter_lines())
            assert len(app.state.event_streams) == 1
        with anyio.fail_after(10):
            while len(app.state.event_streams):
                await anyio.sleep(0.02)


def test_event_envelopes_decode_with_msgspec_as_json(api: Api, run: Run) -> None:
    # The SSE data is plain JSON a client without apomesh can read.
    fake = FakeService()
    session_id = run(fake.start)
    with api(create_app(fake, auth=AuthSettings.off())) as client:
        run(fake.end, session_id)
        text = client.get(f"/v1/sessions/{session_id}/events").text
    datas = [f["data"] for f in parse_frames(text) if "data" in f]
    decoded = [msgspec.json.decode(d) for d in datas]
    assert decoded[0]["event"]["kind"] == "SessionStarted" == decoded[0]["kind"]
    assert decoded[0]["event"]["goal"] == "write a haiku"


def test_json_depth_counts_nesting_outside_strings_without_decoding() -> None:
    from apomesh.api.app import json_depth

    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'{"text": "[[[[{{{{ \\" ]]]] [["}') == 1
    assert json_depth(b"[" * 100_000) == 100_000
    assert json_depth(b'"just a string"') == 0
