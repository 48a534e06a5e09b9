"""What the API, SSE, SDK, fuzz and console tests against a real daemon share: agent definitions
that run on the scripted model, a system of processes that several tests of a module may share,
and small readers of the HTTP API (polling a session, parsing an event stream frame by frame)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from apomesh.testing import Mesh

KEEPALIVE_SECONDS = 0.5
"""The daemons these tests start send an SSE keep-alive this often (15 s by default)."""

TERMINAL = ("completed", "failed", "cancelled")

ECHO: dict[str, Any] = {
    "name": "echo",
    "version": "1.0.0",
    "instructions": "Answer with the goal.",
    "coordination": "solo",
    "model": {"provider": "scripted", "turns": [{"final": "done: {task}"}]},
}


def slow_reader(turns: int = 8, delay: float = 0.3) -> dict[str, Any]:
    """A read-only root agent that takes ``turns * delay`` seconds: no side effects, so a daemon
    restart resumes it by itself."""
    return {
        "name": "slow-reader",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": ["fs.list"],
        "model": {
            "provider": "scripted",
            "turns": [
                {"delay": delay, "tool_calls": [{"tool": "fs.list", "args": {"path": "."}}]}
                for _ in range(turns)
            ]
            + [{"final": "read the workspace"}],
        },
    }


def appender(path: str, lines: int = 6, delay: float = 0.4) -> dict[str, Any]:
    """A root agent that appends ``lines`` lines to ``path``, one per slow turn: side effects, so
    after a daemon restart the session waits on the recoverable list."""
    return {
        "name": "appender",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": ["fs.append"],
        "model": {
            "provider": "scripted",
            "turns": [
                {
                    "delay": delay,
                    "tool_calls": [
                        {"tool": "fs.append", "args": {"path": path, "line": f"line {n}"}}
                    ],
                }
                for n in range(1, lines + 1)
            ]
            + [{"final": f"appended {lines} lines"}],
        },
    }


def fanout_writer(prefix: str, steps: int = 4, delay: float = 0.4) -> dict[str, Any]:
    """A planner and three sub-agents, each appending ``steps`` lines to its own file slowly
    (long enough to kill the worker running one in the middle)."""
    return {
        "name": "fanout-writer",
        "version": "1.0.0",
        "coordination": "fanout",
        "coordination_params": {"max_parallel": 3},
        "model": {
            "provider": "scripted",
            "turns": [{"plan": ["part one", "part two", "part three"]}, {"final": "three parts"}],
        },
        "roles": {
            "worker": {
                "tools": ["fs.append"],
                "model": {
                    "provider": "scripted",
                    "turns": [
                        {
                            "delay": delay,
                            "tool_calls": [
                                {
                                    "tool": "fs.append",
                                    "args": {
                                        "path": f"{prefix}-{{index}}.txt",
                                        "line": f"{{task}}: line {n}",
                                    },
                                }
                            ],
                        }
                        for n in range(1, steps + 1)
                    ]
                    + [{"final": "wrote {task}"}],
                },
            }
        },
    }


def asker(question: str = "Which colour should the cover be?") -> dict[str, Any]:
    """A root agent that asks a human, then answers with what it was told."""
    return {
        "name": "asker",
        "version": "1.0.0",
        "coordination": "solo",
        "tools": ["ask_human"],
        "model": {
            "provider": "scripted",
            "turns": [
                {"tool_calls": [{"tool": "ask_human", "args": {"question": question}}]},
                {"final": "cover chosen"},
            ],
        },
    }


# --- a system several tests share ---------------------------------------------------------


def start_mesh(
    base: Path, *, workers: int = 2, env: dict[str, str] | None = None, auth: bool | None = False
) -> Mesh:
    """A fresh nats-server, an ``apomesh serve`` process with fast SSE keep-alives (asking for
    its first token when ``auth``), and ``workers`` worker processes, registered. ``stop_mesh``
    takes it down."""
    from apomesh.adapters.natsserver import NatsServer, single_node

    server = NatsServer(single_node(base, name="nats"))
    server.start()
    system = Mesh(
        server,
        base,
        env={"APOMESH_HTTP_KEEPALIVE_SECONDS": str(KEEPALIVE_SECONDS), **(env or {})},
        auth=auth,
    )
    try:
        system.start(workers)
    except BaseException:
        stop_mesh(system)
        raise
    return system


def stop_mesh(system: Mesh) -> None:
    try:
        system.close()
    finally:
        system.server.stop()


# --- reading the API ----------------------------------------------------------------------


def bearer(token: str | None) -> dict[str, str]:
    """The headers presenting ``token`` (none for None)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def start(
    url: str,
    goal: str,
    definition: dict[str, Any] | None = None,
    *,
    token: str | None = None,
    **body: Any,
) -> str:
    payload: dict[str, Any] = {"goal": goal, **body}
    if definition is not None:
        payload["definition"] = definition
    response = httpx.post(f"{url}/v1/sessions", json=payload, headers=bearer(token), timeout=30)
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


def view(url: str, session_id: str, token: str | None = None) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/sessions/{session_id}", headers=bearer(token), timeout=30)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def metric(url: str, name: str, **labels: str) -> float | None:
    """One sample of a daemon's ``/metrics`` (``None`` when it serves no such series)."""
    wanted = tuple(sorted(labels.items()))
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and tuple(sorted(sample.labels.items())) == wanted:
                return float(sample.value)
    return None


def wait_until(check: Callable[[], Any], timeout: float = 60.0, what: str = "the condition") -> Any:
    """Poll ``check`` until it answers something truthy (connection errors count as not yet)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.TransportError, AssertionError):
            last = None
        if last:
            return last
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not happen within {timeout} s (last: {last!r})")


def wait_status(
    url: str,
    session_id: str,
    statuses: tuple[str, ...] = TERMINAL,
    timeout: float = 60.0,
    token: str | None = None,
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        body = view(url, session_id, token)
        return body if body["status"] in statuses else None

    result: dict[str, Any] = wait_until(check, timeout, f"session {session_id} in {statuses}")
    return result


def wait_event(
    url: str,
    session_id: str,
    predicate: Callable[[dict[str, Any]], bool],
    timeout: float = 60.0,
    token: str | None = None,
) -> dict[str, Any]:
    """The first event of the session (an envelope as JSON) that ``predicate`` accepts, read
    from the event stream, waiting for it to be appended."""
    with httpx.Client(timeout=httpx.Timeout(30, read=timeout)) as client:
        for item in sse(client, url, session_id, headers=bearer(token)):
            if item.data is not None and predicate(item.data):
                return item.data
    raise AssertionError(f"the stream of {session_id} ended without the awaited event")


def journal_lines(workspace: Path, name: str) -> list[str]:
    path = workspace / name
    return path.read_text().splitlines() if path.exists() else []


@dataclass
class SseItem:
    """One thing read from an event stream: a frame (``id``, ``event``, ``data``) or a comment."""

    id: str | None = None
    event: str | None = None
    data: dict[str, Any] | None = None
    comment: str | None = None
    fields: dict[str, str] = field(default_factory=dict)


def sse(
    client: httpx.Client,
    url: str,
    session_id: str,
    *,
    headers: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
) -> Iterator[SseItem]:
    """The raw event stream of a session, frame by frame and comment by comment, until the
    daemon ends it. Refuses anything but a 200 ``text/event-stream`` answer."""
    with client.stream(
        "GET", f"{url}/v1/sessions/{session_id}/events", headers=headers, params=params
    ) as response:
        if response.status_code != 200:
            response.read()
            raise AssertionError(f"{response.status_code}: {response.text}")
        assert response.headers["content-type"].startswith("text/event-stream")
        item = SseItem()
        for line in response.iter_lines():
            if line == "":
                if item.id is not None or item.data is not None:
                    yield item
                item = SseItem()
                continue
            if line.startswith(":"):
                yield SseItem(comment=line[1:].strip())
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            item.fields[name] = value
            if name == "id":
                item.id = value
            elif name == "event":
                item.event = value
            elif name == "data":
                item.data = json.loads(value)
