"""A session definition cannot choose where a model call goes or which secret it carries: the
endpoints and keys are the daemon's and the workers' configuration (``[providers.openai]``), on
real daemon and worker processes against local capture servers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
from tests.fakes.openai_server import FakeOpenAIServer

from apomesh.testing import Mesh

TIMEOUT = 60.0


def agent(**model: Any) -> dict[str, Any]:
    return {
        "name": "keyed",
        "coordination": "solo",
        "instructions": "Answer.",
        "model": {"provider": "openai", "model": "m", **model},
    }


def credentials_config(path: Path, **endpoints: str) -> Path:
    lines = []
    for name, base_url in endpoints.items():
        lines += [
            f"[providers.openai.credentials.{name}]",
            f'base_url = "{base_url}"',
            'api_key_env = "MODEL_KEY"',
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def restart_daemon_with(mesh: Mesh, config: Path, env: dict[str, str] | None = None) -> None:
    for worker in mesh.workers:
        worker.stop()
    mesh.workers.clear()
    mesh.daemon.extra_args = ("--config", str(config))
    mesh.daemon.env.update(env or {})
    mesh.daemon.restart()


def wait_ended(url: str, session_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        body: dict[str, Any] = httpx.get(f"{url}/v1/sessions/{session_id}").json()
        if body["status"] in ("completed", "failed", "cancelled"):
            return body
        time.sleep(0.1)
    raise AssertionError(f"session {session_id} did not end")


def test_a_definition_naming_an_endpoint_and_a_daemon_secret_is_refused_and_sends_nothing(
    bare_mesh: Mesh,
) -> None:
    with FakeOpenAIServer() as capture:
        # The only worker holds the daemon's API token in its environment, as a worker started
        # beside the daemon would.
        bare_mesh.daemon.start()
        bare_mesh.worker("keyed", env={"APOMESH_HTTP_TOKEN": "the-daemon-secret"})
        capture.reply("captured")
        for model, key in (
            ({"base_url": capture.base_url, "api_key_env": "APOMESH_HTTP_TOKEN"}, "base_url"),
            ({"credential": "default", "api_key_env": "APOMESH_HTTP_TOKEN"}, "api_key_env"),
            ({"options": {"base_url": capture.base_url}}, "base_url"),
            ({"credential": "elsewhere"}, "credential"),
        ):
            response = httpx.post(
                f"{bare_mesh.url}/v1/sessions", json={"goal": "leak", "definition": agent(**model)}
            )
            assert response.status_code == 400, response.text
            body = response.json()
            assert body["error"] == "invalid_definition", body
            assert f".{key}" in body["message"], body
        assert capture.requests == []


def test_a_configured_credential_goes_to_its_own_endpoint_only(bare_mesh: Mesh) -> None:
    with FakeOpenAIServer() as capture, FakeOpenAIServer() as allowed:
        config = credentials_config(bare_mesh.base / "creds.toml", good=allowed.base_url)
        restart_daemon_with(bare_mesh, config, env={"APOMESH_HTTP_TOKEN": "the-daemon-secret"})
        bare_mesh.worker("keyed", env={"MODEL_KEY": "sk-model"}, config=config)
        bare_mesh.wait_workers(1)
        allowed.reply("answered")
        capture.reply("captured")
        headers = {"Authorization": "Bearer the-daemon-secret"}
        response = httpx.post(
            f"{bare_mesh.url}/v1/sessions",
            json={"goal": "answer", "definition": agent(credential="good")},
            headers=headers,
        )
        assert response.status_code == 201, response.text
        ended = wait_ended(bare_mesh.url, response.json()["session_id"])
        assert ended["status"] == "completed", ended
        assert ended["output"] == "answered"
        assert [r.headers.get("Authorization") for r in allowed.requests] == ["Bearer sk-model"]
        assert capture.requests == []


def test_the_worker_checks_the_credential_again(bare_mesh: Mesh) -> None:
    """The daemon knows a credential the worker does not: the worker refuses to call anything."""
    with FakeOpenAIServer() as allowed:
        daemon_config = credentials_config(bare_mesh.base / "daemon.toml", good=allowed.base_url)
        worker_config = credentials_config(bare_mesh.base / "worker.toml", other=allowed.base_url)
        restart_daemon_with(bare_mesh, daemon_config)
        bare_mesh.worker("keyed", env={"MODEL_KEY": "sk-model"}, config=worker_config)
        bare_mesh.wait_workers(1)
        allowed.reply("should not be asked")
        response = httpx.post(
            f"{bare_mesh.url}/v1/sessions",
            json={"goal": "answer", "definition": agent(credential="good")},
        )
        assert response.status_code == 201, response.text
        ended = wait_ended(bare_mesh.url, response.json()["session_id"])
        assert ended["status"] == "failed", ended
        assert "credential" in str(ended), ended
        assert allowed.requests == []
