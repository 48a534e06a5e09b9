"""A real model API fails the way real APIs do, on real processes (nats-server, ``apomesh
serve``, an ``apomesh worker``) against the local OpenAI-compatible server: a session rides
through a 429 with ``Retry-After``, a 503 and a timeout and completes, showing the wait while it
waits and its token usage after (``max_tokens`` counts what the API counted); a 401 stops it with the provider's own message, and the
operator resumes it once the key is fixed; a typo in ``[model]`` is refused at submit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.api_support import metric
from tests.fakes.openai_server import FakeOpenAIServer
from tests.fakes.openai_shapes import OLLAMA, OPENAI, WRITE_ARGS

from apomesh.testing import Mesh

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def model_api() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, model_api: FakeOpenAIServer) -> Iterator[Mesh]:
    from apomesh.adapters.natsserver import NatsServer, single_node

    base = tmp_path_factory.mktemp("retries")
    config = Path(base / "providers.toml")
    config.write_text(
        "[providers.openai.credentials.default]\n"
        f'base_url = "{model_api.base_url}"\n'
        'api_key_env = "MODEL_KEY"\n'
        # The tutorial's credential (docs/providers.md), on the same local server.
        "[providers.openai.credentials.local]\n"
        f'base_url = "{model_api.base_url}"\n'
        'api_key_env = ""\n'
    )
    server = NatsServer(single_node(base, name="nats"))
    server.start()
    mesh = Mesh(server, base)
    mesh.daemon.extra_args = ("--config", str(config))
    try:
        mesh.daemon.start()
        mesh.worker("model-caller", env={"MODEL_KEY": "sk-test-key"}, config=config)
        mesh.wait_workers(1)
        yield mesh
    finally:
        mesh.close()
        server.stop()


def agent(**model: Any) -> dict[str, Any]:
    return {
        "name": "notes",
        "coordination": "solo",
        "instructions": "Write what you are asked to notes.txt.",
        "tools": ["fs.write"],
        "model": {
            "provider": "openai",
            "model": "gpt-4o-mini",
            "timeout": 0.5,
            # Fast backoff for the test; the 429's Retry-After is honoured as given.
            "retry": {"attempts": 6, "initial_delay": 0.05, "max_delay": 0.2},
            **model,
        },
        "budget": {"max_seconds": 120},
    }


def start(url: str, definition: dict[str, Any]) -> str:
    response = httpx.post(
        f"{url}/v1/sessions", json={"goal": "write hello", "definition": definition}
    )
    assert response.status_code == 201, response.text
    session_id: str = response.json()["session_id"]
    return session_id


def view(url: str, session_id: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/v1/sessions/{session_id}").json()
    return body


def wait_for(url: str, session_id: str, statuses: tuple[str, ...]) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        body = view(url, session_id)
        if body["status"] in statuses:
            return body
        time.sleep(0.05)
    raise AssertionError(f"session {session_id} never became {statuses}: {body}")


def event_kinds(url: str, session_id: str, last_index: int) -> list[dict[str, Any]]:
    """The session's events as the SSE stream sends them, up to ``last_index``."""
    import json

    events: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{url}/v1/sessions/{session_id}/events", timeout=30) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                envelope = json.loads(line[5:])
                events.append(envelope)
                if envelope["index"] >= last_index:
                    break
    return [e["event"] for e in events]


def test_a_session_rides_through_a_429_a_503_and_a_timeout_and_completes(
    system: Mesh, model_api: FakeOpenAIServer
) -> None:
    model_api.clear()
    rate_limited = OPENAI.errors["rate_limited"]
    model_api.replay(rate_limited.body, status=429, headers={"retry-after": "2"})
    model_api.replay(OPENAI.errors["overloaded"].body, status=503)
    model_api.replay(OPENAI.final, delay=1.5)  # slower than the 0.5 s timeout: abandoned
    model_api.replay(OPENAI.tool_call)
    model_api.replay(OPENAI.final)

    session_id = start(system.url, agent())

    # While the worker honours the Retry-After, the session says what it waits for.
    deadline = time.monotonic() + TIMEOUT
    waiting = None
    while waiting is None and time.monotonic() < deadline:
        body = view(system.url, session_id)
        waiting = body["agents"][0].get("retrying") if body["agents"] else None
        assert body["status"] == "running", body
        time.sleep(0.05)
    assert waiting is not None
    assert waiting["status"] == 429 and waiting["attempt"] == 1 and waiting["delay"] == 2.0
    assert "Rate limit reached for gpt-4o-mini" in waiting["reason"]

    ended = wait_for(system.url, session_id, ("completed", "failed", "cancelled", "recoverable"))
    assert ended["status"] == "completed", ended
    assert ended["output"] == OPENAI.final["choices"][0]["message"]["content"]
    notes = system.daemon.workspace / session_id / "notes.txt"
    assert notes.read_text() == WRITE_ARGS["content"]
    assert len(model_api.requests) == 5
    (root,) = ended["agents"]
    assert root.get("retrying") is None

    # Usage of the two calls that answered, as the API counted it.
    prompt = OPENAI.tool_call["usage"]["prompt_tokens"] + OPENAI.final["usage"]["prompt_tokens"]
    completion = (
        OPENAI.tool_call["usage"]["completion_tokens"] + OPENAI.final["usage"]["completion_tokens"]
    )
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "model_calls": 2}
    assert ended["usage"] == usage
    assert root["usage"] == usage

    # The log keeps each wait: the 429's Retry-After, then the backoff after the 503 and the
    # timeout.
    kinds = event_kinds(system.url, session_id, ended["last_index"])
    retries = [e for e in kinds if e["kind"] == "ModelRetrying"]
    assert [(r["attempt"], r["status"]) for r in retries] == [(1, 429), (2, 503), (3, None)]
    assert retries[0]["delay"] == 2.0
    assert "within 0.5 s" in retries[2]["reason"]

    labels = {"provider": "openai", "model": "gpt-4o-mini"}
    assert metric(system.url, "apomesh_model_call_seconds_count", outcome="ok", **labels) == 2
    assert metric(system.url, "apomesh_model_call_seconds_count", outcome="error", **labels) == 3
    assert metric(system.url, "apomesh_model_tokens_total", kind="prompt", **labels) == prompt
    assert (
        metric(system.url, "apomesh_model_tokens_total", kind="completion", **labels) == completion
    )


def test_a_401_stops_the_session_with_the_provider_message_and_the_operator_resumes_it(
    system: Mesh, model_api: FakeOpenAIServer
) -> None:
    model_api.clear()
    model_api.replay(OPENAI.errors["unauthorized"].body, status=401)
    session_id = start(system.url, agent(model="gpt-4o"))

    stopped = wait_for(system.url, session_id, ("completed", "failed", "cancelled", "recoverable"))
    assert stopped["status"] == "recoverable", stopped
    assert "HTTP 401" in stopped["reason"]
    assert "Incorrect API key provided" in stopped["reason"]
    assert "sk-proj" not in stopped["reason"]
    assert len(model_api.requests) == 1  # a 401 is not tried again
    listed = httpx.get(f"{system.url}/v1/recoverable").json()
    rows = listed["sessions"] if isinstance(listed, dict) else listed
    (row,) = [r for r in rows if r["session_id"] == session_id]
    assert row["category"] == "model_failed"

    # The key is fixed (here: the API answers again); the operator resumes the session.
    model_api.replay(OPENAI.final)
    resumed = httpx.post(f"{system.url}/v1/sessions/{session_id}/resume", json={"confirm": True})
    assert resumed.status_code < 300, resumed.text
    ended = wait_for(system.url, session_id, ("completed", "failed", "cancelled"))
    assert ended["status"] == "completed", ended
    assert len(model_api.requests) == 2


def test_max_tokens_stops_the_agent_on_the_tokens_the_api_counted(
    system: Mesh, model_api: FakeOpenAIServer
) -> None:
    model_api.clear()
    model_api.replay(OPENAI.tool_call)  # 82 + 18 tokens: over the budget of 50
    model_api.replay(OPENAI.final)
    definition = {**agent(), "budget": {"max_tokens": 50}}
    ended = wait_for(
        system.url, start(system.url, definition), ("completed", "failed", "cancelled")
    )
    assert ended["status"] == "failed", ended
    assert "max_tokens 50" in ended["reason"]
    assert len(model_api.requests) == 1  # never asked again once the budget was spent
    assert ended["usage"] == {"prompt_tokens": 82, "completion_tokens": 18, "model_calls": 1}


@pytest.mark.parametrize(
    ("model", "path"),
    [
        ({"temprature": 0.2}, "$.model.temprature"),
        ({"api_key_evn": "OTHER_KEY"}, "$.model.api_key_evn"),
        ({"retry": {"atempts": 2}}, "$.model.retry"),
    ],
)
def test_a_typo_in_the_model_table_is_refused_at_submit(
    system: Mesh, model_api: FakeOpenAIServer, model: dict[str, Any], path: str
) -> None:
    model_api.clear()
    response = httpx.post(
        f"{system.url}/v1/sessions", json={"goal": "typo", "definition": agent(**model)}
    )
    assert response.status_code == 400, response.text
    assert path in response.json()["message"]
    assert model_api.requests == []


def tutorial_blocks() -> dict[str, str]:
    """The TOML blocks of docs/providers.md's tutorial, by the file name its text gives them."""
    import re

    text = (Path(__file__).parents[2] / "docs" / "providers.md").read_text(encoding="utf-8")
    tutorial = text[text.index("## 5. Tutorial") :]
    blocks = re.findall(r"Save this as `([^`]+)`:\n\n```toml\n(.*?)```", tutorial, re.S)
    return dict(blocks)


def test_the_tutorial_agent_runs_end_to_end_on_replayed_ollama_answers(
    system: Mesh, model_api: FakeOpenAIServer, tmp_path: Path
) -> None:
    import subprocess
    import sys
    import tomllib

    blocks = tutorial_blocks()
    assert set(blocks) == {"apomesh.toml", "notes.toml"}
    tutorial_config = tomllib.loads(blocks["apomesh.toml"])
    assert tutorial_config["providers"]["openai"]["credentials"]["local"]["api_key_env"] == ""
    definition = tmp_path / "notes.toml"
    definition.write_text(blocks["notes.toml"])
    model_api.clear()
    model_api.replay(OLLAMA.tool_call)
    model_api.replay(OLLAMA.final)

    goal = "Write a haiku about the sea into sea.txt"
    command = [sys.executable, "-m", "apomesh", "run", goal]
    ran = subprocess.run(
        [*command, "--definition", str(definition), "--url", system.url],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert ran.returncode == 0, ran.stderr
    listed = httpx.get(f"{system.url}/v1/sessions", params={"q": "haiku"}).json()
    rows = listed["sessions"] if isinstance(listed, dict) else listed
    (row,) = rows
    ended = wait_for(system.url, row["session_id"], ("completed", "failed", "cancelled"))
    assert ended["status"] == "completed", ended
    assert [r.body["model"] for r in model_api.requests] == ["qwen2.5:7b", "qwen2.5:7b"]
    assert all("Authorization" not in r.headers for r in model_api.requests)
    assert ended["usage"]["model_calls"] == 2
