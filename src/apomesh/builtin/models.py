"""The ``scripted`` model provider: plays back a definition's script turns, one per model call.

The position in the script lives in the agent's working memory (``memory["script_pos"]``), handed
in with each ``ModelRequest`` and returned updated in ``ModelResponse.memory``, so a resumed agent
continues where its snapshot left off. ``{task}`` and ``{index}`` in every string of a turn (text,
tool-call arguments at any depth, plan items, the final answer) expand to the request's sub-task
text and number. Script files are resolved to inline ``turns`` by the runtime before a session is
pinned; this provider reads ``ModelSpec.turns`` only.

When the script runs out the model answers a final ``""`` with a ``text`` note saying so: the
agent ends cleanly with an empty output instead of failing, and the note shows in its
conversation. A spec that still names an unresolved ``script`` file is a ``DefinitionError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from apomesh.core.definition import ModelSpec, ScriptTurn, ToolCallSpec
from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import Model, ModelRequest, ModelResponse

SCRIPT_POSITION = "script_pos"
"""The working-memory key holding the index of the next turn to play."""


def expand(value: Any, task: str, index: int) -> Any:
    """``value`` with ``{task}`` and ``{index}`` replaced in every string, at any depth."""
    if isinstance(value, str):
        return value.replace("{task}", task).replace("{index}", str(index))
    if isinstance(value, dict):
        return {key: expand(item, task, index) for key, item in value.items()}
    if isinstance(value, list):
        return [expand(item, task, index) for item in value]
    return value


class ScriptedModel:
    """Answers each call with the next turn of its script."""

    def __init__(self, turns: list[ScriptTurn]) -> None:
        self.turns = list(turns)

    async def respond(self, request: ModelRequest) -> ModelResponse:
        position = request.memory.get(SCRIPT_POSITION, 0)
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise DefinitionError(
                f"working memory holds an invalid script position {position!r}",
                where="scripted model",
            )
        if position >= len(self.turns):
            return ModelResponse(
                text=f"(the script has no turn {position + 1}: all {len(self.turns)} were played)",
                final="",
                memory={**request.memory, SCRIPT_POSITION: position},
            )
        turn = self.turns[position]
        if turn.delay > 0:
            await anyio.sleep(turn.delay)
        task, index = request.task, request.task_index
        return ModelResponse(
            text=expand(turn.text, task, index),
            tool_calls=[
                ToolCallSpec(tool=call.tool, args=expand(call.args, task, index))
                for call in turn.tool_calls
            ],
            plan=expand(turn.plan, task, index) if turn.plan is not None else None,
            final=expand(turn.final, task, index) if turn.final is not None else None,
            tokens=turn.tokens,
            memory={**request.memory, SCRIPT_POSITION: position + 1},
        )


class ScriptedProvider:
    """The ``scripted`` provider: it takes no options (its turns are ``[model] turns``)."""

    name: str = "scripted"
    options: Mapping[str, str] = {}

    def create(self, spec: ModelSpec) -> Model:
        if spec.turns is None and spec.script is not None:
            raise DefinitionError(
                f"script {spec.script!r} was not resolved to inline turns before the session "
                "was pinned",
                where="scripted model",
            )
        return ScriptedModel(spec.turns or [])
