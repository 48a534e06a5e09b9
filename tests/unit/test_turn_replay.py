"""The agent loop against an in-memory daemon and a model that never repeats itself: a turn with a
side-effecting call is reported before the call runs, a second dispatch whose memory holds the
recorded turn replays it (same call, same journal key) without asking the model, and the tool sees
the same ``ctx.idempotency_key`` both times, the documented hash of session, agent and journal key.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.chaos_kit import shape_of

from apomesh.core.definition import ModelSpec, ToolCallSpec
from apomesh.plugins.api import ModelRequest, ModelResponse, Tool
from apomesh.runtime.agent_loop import run_agent
from apomesh.runtime.protocol import (
    AgentMemory,
    Done,
    JournalBegin,
    NodeReport,
    Reply,
    Report,
    Run,
    TurnReport,
)


class Lost(Exception):
    """The worker died here."""


class FreshModel:
    """Each call a new line to append; the second call answers."""

    def __init__(self) -> None:
        self.calls = 0

    async def respond(self, request: ModelRequest) -> ModelResponse:
        self.calls += 1
        if any(m.role == "tool" for m in request.messages):
            return ModelResponse(final=f"final {uuid.uuid4().hex}")
        line = f"charge {uuid.uuid4().hex}"
        return ModelResponse(tool_calls=[ToolCallSpec("fs.append", {"path": "p", "line": line})])


class FreshProvider:
    name = "scripted"

    def __init__(self) -> None:
        self.model = FreshModel()

    def create(self, spec: ModelSpec) -> FreshModel:
        return self.model


@pytest.mark.anyio
async def test_a_recorded_turn_is_replayed_with_the_same_call_and_idempotency_key(
    tmp_path: Path,
) -> None:
    definition = {
        "name": "payer",
        "coordination": "solo",
        "tools": ["fs.append"],
        "model": {"provider": "scripted", "turns": [{"final": "unused"}]},
    }
    config = shape_of(definition).root
    seen: list[tuple[str, dict[str, Any]]] = []

    async def charge(ctx: Any, args: dict[str, Any]) -> str:
        seen.append((ctx.idempotency_key, dict(args)))
        return "charged"

    tools = {"fs.append": Tool("fs.append", "charge", charge, side_effect=True)}
    provider = FreshProvider()
    turns: list[TurnReport] = []
    intents: list[JournalBegin] = []

    async def daemon(report: Report) -> Reply:
        if isinstance(report, TurnReport):
            turns.append(report)
            if report.intent is None:  # the final answer, recorded before Done
                return Reply("ok")
            intents.append(report.intent)
            return Reply("ok", decision="run")
        if isinstance(report, JournalBegin):
            intents.append(report)
            return Reply("ok", decision="run")
        if isinstance(report, NodeReport) and report.results and len(seen) == 1:
            raise Lost  # the effect ran; its result never reached the daemon
        return Reply("ok")

    def dispatch(epoch: int, memory: AgentMemory | None) -> Run:
        return Run("s-1", "root", epoch, config, "act", "pay", memory=memory)

    async def run(epoch: int, memory: AgentMemory | None) -> Done:
        return await run_agent(
            dispatch(epoch, memory),
            worker_id="w",
            workspace=tmp_path,
            tools=tools,
            providers={"scripted": provider},  # type: ignore[dict-item]
            supervisors=[],
            send=daemon,
        )

    with pytest.raises(Lost):
        await run(1, None)
    (turn,) = turns
    assert turn.intent is not None, "the first intent rides on its turn's report"
    assert provider.model.calls == 1
    memory = AgentMemory(
        messages=turn.new_messages,
        model=turn.model,
        budget=turn.budget,
        step=turn.step,
        prompt=turn.prompt,
        call_counts=turn.call_counts,
        turn=turn.turn,
    )
    done = await run(2, memory)
    assert done.outcome == "final"
    assert turns[-1].turn.response.final == done.output  # recorded before the agent ended
    assert provider.model.calls == 2, "the recorded turn was asked of the model again"
    (first, second) = intents
    assert (first.key, first.args) == (second.key, second.args)
    assert seen[0] == seen[1]
    expected = hashlib.sha256(
        "\0".join(("apomesh-idempotency", "s-1", "root", first.key)).encode()
    ).hexdigest()
    assert seen[0][0] == expected
