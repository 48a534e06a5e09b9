"""The same agent on the ``openai`` and ``anthropic`` providers, streaming, on real daemon and
worker processes against the replayed answers of OpenAI, vLLM, Ollama, llama.cpp server and
Anthropic: the pieces of each model turn reach an SSE client live (while the model is still
writing), as frames without an ``id``, before the turn's events; the log keeps the whole turn and
a reconnect resumes from the log; the token usage the API counted (the last chunk's, or
Anthropic's ``message_start`` and ``message_delta``) shows on the session view and in /metrics on
both providers, streaming or not; a delta sent by a worker that does not run the agent is never
shown; a worker killed while the model writes loses only the preview (the model is asked again,
its tool call is not run again)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.api_support import SseItem, metric, sse, wait_status
from tests.fakes.stream_server import FLAVOURS, ReplayServer

from apomesh.adapters.natsserver import NatsServer, single_node
from apomesh.plugins.api import ModelDelta
from apomesh.runtime.protocol import ENCODER, VERB_DELTA, TurnDelta, control_subject
from apomesh.testing import Mesh

TEXT = "The note is written: note.txt holds the greeting."
HOLD = 4
"""Events of the final answer the replay server sends before it waits for the test."""


def credentials(path: Path, servers: dict[str, ReplayServer]) -> Path:
    lines = []
    for flavour, server in servers.items():
        provider = "anthropic" if flavour == "anthropic" else "openai"
        lines += [
            f"[providers.{provider}.credentials.{flavour}]",
            f'base_url = "{server.base_url}"',
            'api_key_env = ""',
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ReplayServer]]:
    replays = {flavour: ReplayServer(flavour) for flavour in FLAVOURS}
    for replay in replays.values():
        replay.start()
    try:
        yield replays
    finally:
        for replay in replays.values():
            replay.release()
            replay.stop()


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory, servers: dict[str, ReplayServer]
) -> Iterator[Mesh]:
    base = tmp_path_factory.mktemp("streaming")
    config = credentials(base / "providers.toml", servers)
    nats = NatsServer(single_node(base, name="nats"))
    nats.start()
    mesh = Mesh(nats, base)
    mesh.daemon.extra_args = ("--config", str(config))
    try:
        mesh.daemon.start()
        mesh.worker("streamer", config=config)
        mesh.wait_workers(1)
        yield mesh
    finally:
        mesh.close()
        nats.stop()


def agent(flavour: str, model: str | None = None) -> dict[str, Any]:
    """One agent; only the provider, the credential and the model's name (by default one per
    flavour, for each flavour's own /metrics series) change."""
    return {
        "name": "note-taker",
        "coordination": "solo",
        "instructions": "Write the note the user asks for, then say what you did.",
        "tools": ["fs.write"],
        "model": {
            "provider": "anthropic" if flavour == "anthropic" else "openai",
            "model": model or f"m-{flavour}",
            "credential": flavour,
            "stream": True,
        },
    }


def forge_delta(nats_url: str, daemon_id: str, session_id: str) -> None:
    """A delta for the session from a worker that does not run it."""
    import nats

    async def publish() -> None:
        nc = await nats.connect(nats_url)
        try:
            delta = TurnDelta(
                "intruder", session_id, "root", 1, 2, ModelDelta("text", text="FORGED")
            )
            await nc.publish(
                control_subject(daemon_id, VERB_DELTA, "intruder"), ENCODER.encode(delta)
            )
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(publish())


def deltas(items: list[SseItem], kind: str, step: int | None = None) -> list[dict[str, Any]]:
    return [
        item.data["delta"]
        for item in items
        if item.event == "ModelDelta"
        and item.data is not None
        and item.data["delta"]["kind"] == kind
        and (step is None or item.data["step"] == step)
    ]


def assert_usage(
    system: Mesh, ended: dict[str, Any], flavour: str, model: str, prompt: int, completion: int
) -> None:
    """The session view's usage (the session's and its agent's) and /metrics count the two
    model calls with the tokens the API gave."""
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "model_calls": 2}
    assert ended["usage"] == usage
    assert [a["usage"] for a in ended["agents"]] == [usage]
    labels = {"provider": "anthropic" if flavour == "anthropic" else "openai", "model": model}
    assert metric(system.url, "apomesh_model_call_seconds_count", outcome="ok", **labels) == 2
    assert metric(system.url, "apomesh_model_tokens_total", kind="prompt", **labels) == prompt
    assert (
        metric(system.url, "apomesh_model_tokens_total", kind="completion", **labels) == completion
    )


def first(items: list[SseItem], event: str) -> int:
    return next(i for i, item in enumerate(items) if item.event == event)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_deltas_reach_the_client_live_and_the_log_keeps_the_turn(
    system: Mesh, servers: dict[str, ReplayServer], flavour: str
) -> None:
    server = servers[flavour]
    args = {"path": f"{flavour}.txt", "content": "hello"}
    # The tool call waits for the client to be connected (deltas are never replayed); the
    # answer stops half-way, for the test to look at what the client has by then.
    connected = server.tool_call(
        "fs__write", args, prompt_tokens=90, completion_tokens=20, hold_after=0
    )
    writing = server.text(TEXT, prompt_tokens=120, completion_tokens=12, hold_after=HOLD)
    assert connected is not None and writing is not None
    created = httpx.post(
        f"{system.url}/v1/sessions", json={"goal": "write a note", "definition": agent(flavour)}
    )
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]

    items: list[SseItem] = []
    seen_while_writing = ""
    with httpx.Client(timeout=60.0) as client:
        for item in sse(client, system.url, session_id, params={"deltas": "true"}):
            if item.comment is not None:
                continue
            items.append(item)
            if not connected.go.is_set():
                # The stream follows the deltas from before its first frame.
                assert connected.reached.wait(30), "the model was never asked"
                connected.release()
            if seen_while_writing or not deltas(items, "text", 2):
                continue
            # The model has begun its answer and is held mid-way by the server: what the
            # client has now, it got while the answer was being written.
            assert writing.reached.wait(30), "the replay server never reached its hold"
            seen_while_writing = "".join(d["text"] for d in deltas(items, "text", 2))
            assert all(item.event != "SessionEnded" for item in items)
            forge_delta(system.nats_url, system.daemon.daemon_id, session_id)
            writing.release()

    assert seen_while_writing and TEXT.startswith(seen_while_writing)
    assert len(seen_while_writing) < len(TEXT)
    ended = wait_status(system.url, session_id, ("completed",))
    assert ended["output"] == TEXT
    assert_usage(system, ended, flavour, f"m-{flavour}", prompt=90 + 120, completion=20 + 12)

    frames = [item for item in items if item.event == "ModelDelta"]
    assert frames and all(item.id is None for item in frames)
    assert all(item.id is not None for item in items if item.event != "ModelDelta")
    assert {item.data["agent"] for item in frames if item.data} == {"root"}
    # The tool call, piece by piece, before the turn's first event; the answer before the end.
    calls = deltas(items, "tool_call", 1)
    assert calls[0]["tool"] == "fs.write"
    assert json.loads("".join(d.get("arguments", "") for d in calls)) == args
    call_frame = next(
        i
        for i, item in enumerate(items)
        if item.data and item.data.get("delta", {}).get("kind") == "tool_call"
    )
    assert call_frame < first(items, "ToolCallIntent")
    # The log keeps the whole turn: the call as the model made it, the answer as the output.
    logged_call = items[first(items, "ToolCallIntent")].data
    assert logged_call is not None
    assert (logged_call["event"]["tool"], logged_call["event"]["args"]) == ("fs.write", args)
    session_end = items[first(items, "SessionEnded")].data
    assert session_end is not None and session_end["event"]["output"] == TEXT
    assert "".join(d["text"] for d in deltas(items, "text", 2)) == TEXT
    last_text = max(
        i
        for i, item in enumerate(items)
        if item.data and item.data.get("delta", {}).get("kind") == "text"
    )
    assert last_text < first(items, "SessionEnded")
    assert "FORGED" not in json.dumps([item.data for item in frames])

    # A reconnect resumes from the log: exactly the events after the one it names, no previews.
    intent = items[first(items, "ToolCallIntent")]
    assert intent.id is not None
    with httpx.Client(timeout=60.0) as client:
        again = [
            item
            for item in sse(
                client,
                system.url,
                session_id,
                headers={"Last-Event-ID": intent.id},
                params={"deltas": "true"},
            )
            if item.comment is None
        ]
    logged = [item for item in items if item.id is not None and int(item.id) > int(intent.id)]
    assert [item.id for item in again] == [item.id for item in logged]
    assert all(item.event != "ModelDelta" for item in again)


def test_the_same_agent_on_anthropic_without_streaming_sends_no_deltas(
    system: Mesh, servers: dict[str, ReplayServer]
) -> None:
    server = servers["anthropic"]
    server.tool_call(
        "fs__write",
        {"path": "whole.txt", "content": "hello"},
        prompt_tokens=50,
        completion_tokens=7,
    )
    server.text(TEXT, prompt_tokens=80, completion_tokens=10)
    definition = agent("anthropic", model="m-anthropic-whole")
    definition["model"]["stream"] = False
    created = httpx.post(
        f"{system.url}/v1/sessions", json={"goal": "write a note", "definition": definition}
    )
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]
    with httpx.Client(timeout=60.0) as client:
        items = [
            item
            for item in sse(client, system.url, session_id, params={"deltas": "true"})
            if item.comment is None
        ]
    ended = wait_status(system.url, session_id, ("completed",))
    assert ended["output"] == TEXT
    assert_usage(system, ended, "anthropic", "m-anthropic-whole", prompt=50 + 80, completion=17)
    assert "ToolCallRecorded" in [item.event for item in items]
    assert all(item.event != "ModelDelta" for item in items)
    assert "stream" not in server.requests[-1].body


def test_a_worker_killed_mid_stream_loses_only_the_preview(
    system: Mesh, servers: dict[str, ReplayServer]
) -> None:
    """Last in the module: it replaces the module's worker."""
    server = servers["vllm"]
    args = {"path": "killed.txt", "content": "once"}
    connected = server.tool_call("fs__write", args, hold_after=0)
    cut_short = server.text(TEXT, hold_after=HOLD)
    server.text(TEXT, prompt_tokens=120, completion_tokens=12)
    assert connected is not None and cut_short is not None
    created = httpx.post(
        f"{system.url}/v1/sessions", json={"goal": "write a note", "definition": agent("vllm")}
    )
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]

    items: list[SseItem] = []
    killed = False
    with httpx.Client(timeout=60.0) as client:
        for item in sse(client, system.url, session_id, params={"deltas": "true"}):
            if item.comment is not None:
                continue
            items.append(item)
            if not connected.go.is_set():
                assert connected.reached.wait(30), "the model was never asked"
                connected.release()
            if killed or not deltas(items, "text", 2):
                continue
            assert cut_short.reached.wait(30)
            # The model is half-way through its answer: its worker dies.
            for worker in system.workers:
                worker.kill()
            system.worker("streamer-2", config=system.base / "providers.toml")
            killed = True
            cut_short.release()

    assert wait_status(system.url, session_id, ("completed",))["output"] == TEXT
    kinds = [item.event for item in items]
    assert kinds.count("ToolCallIntent") == 1 and kinds.count("ToolCallRecorded") == 1
    assert "AgentResuming" in kinds
    # The preview of the lost answer stops where the worker died; the answer asked again starts
    # over (``start``) and is whole.
    step_two = [
        item.data["delta"]
        for item in items
        if item.event == "ModelDelta" and item.data and item.data["step"] == 2
    ]
    starts = [i for i, d in enumerate(step_two) if d["kind"] == "start"]
    assert len(starts) == 2, step_two
    lost = "".join(d.get("text", "") for d in step_two[starts[0] : starts[1]])
    assert lost and TEXT.startswith(lost) and lost != TEXT
    assert "".join(d.get("text", "") for d in step_two[starts[1] :]) == TEXT
    assert len([r for r in server.requests if r.body.get("stream")]) >= 3
