"""The pieces of model turns on the event stream, on a real server over the in-memory service:
only a stream that asks for them (``?deltas=true``) gets them, live, as frames without an ``id``
between the log's events; every other stream is the log's events alone."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import httpx
import pytest
from tests.fakes.fake_service import FakeService, serving

from apomesh.api.app import create_app
from apomesh.api.auth import AuthSettings
from apomesh.plugins.api import ModelDelta
from apomesh.runtime.protocol import TurnDelta

pytestmark = pytest.mark.anyio


def frames(lines: list[str]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in lines:
        if not line:
            if current:
                out.append(current)
            current = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            current[name] = value.removeprefix(" ")
    return out


async def test_only_a_stream_that_asks_gets_the_deltas_live_and_without_an_id() -> None:
    fake = FakeService()
    session_id = await fake.start()
    app = create_app(fake, auth=AuthSettings.off(), keepalive_seconds=0.05)
    path = f"/v1/sessions/{session_id}/events"
    seen: dict[str, list[str]] = {"with": [], "without": []}

    async def read(name: str, params: dict[str, str], client: httpx.AsyncClient) -> None:
        async with client.stream("GET", path, params=params) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                seen[name].append(line)

    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=20) as client:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(read, "with", {"deltas": "true"}, client)
                group.start_soon(read, "without", {}, client)
                # Once the stream that asked follows the deltas and both are past the replay:
                while fake.deltas.followers(session_id) < 1 or not all(
                    ": keep-alive" in lines for lines in seen.values()
                ):
                    await anyio.sleep(0.01)
                for piece in ("Hel", "lo"):
                    fake.deltas.publish(
                        TurnDelta("w1", session_id, "root", 1, 1, ModelDelta("text", text=piece))
                    )
                fake.deltas.publish(
                    TurnDelta("w1", "another-session", "root", 1, 1, ModelDelta("text", text="x"))
                )
                # The deltas of this session have reached the stream that asked for them.
                deadline = time.monotonic() + 20
                while sum("ModelDelta" in line for line in seen["with"]) < 2:
                    assert time.monotonic() < deadline
                    await anyio.sleep(0.01)
                await fake.end(session_id, output="Hello")

    with_deltas = frames(seen["with"])
    pieces = [f for f in with_deltas if f.get("event") == "ModelDelta"]
    assert [json.loads(f["data"]) for f in pieces] == [
        {"session_id": session_id, "agent": "root", "step": 1, "delta": {"kind": "text", "text": t}}
        for t in ("Hel", "lo")
    ]
    assert all("id" not in f for f in pieces)
    events: list[dict[str, Any]] = [f for f in with_deltas if f.get("event") != "ModelDelta"]
    assert [f["event"] for f in events][-1] == "SessionEnded"
    assert with_deltas.index(pieces[-1]) < with_deltas.index(events[-1])
    without = frames(seen["without"])
    assert [f["event"] for f in without] == [f["event"] for f in events]
    assert [f["id"] for f in without] == [f["id"] for f in events]


async def test_deltas_must_be_true_or_false() -> None:
    fake = FakeService()
    session_id = await fake.start()
    app = create_app(fake, auth=AuthSettings.off())
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=20) as client:
        response = await client.get(f"/v1/sessions/{session_id}/events", params={"deltas": "yes"})
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_query"
