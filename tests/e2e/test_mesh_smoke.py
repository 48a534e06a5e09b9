"""A whole system on real processes: a fanout session completes through the REST API."""

from __future__ import annotations

import time

import httpx

from apomesh.demo import DEMO_AGENT
from apomesh.testing import Mesh


def test_fanout_session_completes_on_worker_processes(mesh: Mesh) -> None:
    response = httpx.post(
        f"{mesh.url}/v1/sessions", json={"goal": "write", "definition": DEMO_AGENT}
    )
    assert response.status_code == 201
    session_id = response.json()["session_id"]
    deadline = time.monotonic() + 60
    view = {}
    while time.monotonic() < deadline:
        view = httpx.get(f"{mesh.url}/v1/sessions/{session_id}").json()
        if view["status"] in ("completed", "failed"):
            break
        time.sleep(0.1)
    assert view["status"] == "completed", view
    for i in range(3):
        lines = (mesh.daemon.workspace / session_id / f"chapter-{i}.txt").read_text().splitlines()
        assert len(lines) == len(set(lines)) == 4
