"""The ``scripted`` model: playback position in working memory, expansion, delays, running out."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from apomesh.builtin.models import SCRIPT_POSITION, ScriptedProvider
from apomesh.core.definition import ModelSpec, ScriptTurn, ToolCallSpec, parse_script
from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import Model, ModelRequest, ModelResponse

pytestmark = pytest.mark.anyio

SCRIPT = parse_script(
    {
        "turns": [
            {
                "tool_calls": [
                    {
                        "tool": "fs.append",
                        "args": {
                            "path": "log-{index}.txt",
                            "line": "working on {task}",
                            "meta": {"tags": ["n{index}", 7], "note": "{task}!"},
                        },
                    }
                ],
                "tokens": 11,
            },
            {"plan": ["first part of {task}", "second part"], "text": "planning {index}"},
            {"final": "done: {task} #{index}", "tokens": 3},
        ]
    }
)


def model_for(turns: list[ScriptTurn]) -> Model:
    return ScriptedProvider().create(ModelSpec(provider="scripted", turns=turns))


async def ask(model: Model, memory: dict[str, Any]) -> ModelResponse:
    request = ModelRequest(
        instructions="",
        messages=[],
        tools=[],
        memory=memory,
        task="the report",
        task_index=2,
    )
    return await model.respond(request)


async def test_turns_play_in_order_with_the_position_in_memory() -> None:
    model = model_for(SCRIPT)
    first = await ask(model, {})
    second = await ask(model, first.memory)
    third = await ask(model, second.memory)

    assert first.tool_calls and first.plan is None and first.final is None
    assert second.plan is not None
    assert third.final is not None
    assert [r.memory[SCRIPT_POSITION] for r in (first, second, third)] == [1, 2, 3]
    assert (first.tokens, second.tokens, third.tokens) == (11, 0, 3)


async def test_a_fresh_model_continues_from_the_position_in_a_restored_memory() -> None:
    # The position travels with the agent's snapshot, not with the model object.
    resumed = await ask(model_for(SCRIPT), {SCRIPT_POSITION: 2, "other": "kept"})
    assert resumed.final == "done: the report #2"
    assert resumed.memory == {SCRIPT_POSITION: 3, "other": "kept"}


async def test_task_and_index_expand_everywhere() -> None:
    model = model_for(SCRIPT)
    first = await ask(model, {})
    assert first.tool_calls == [
        ToolCallSpec(
            "fs.append",
            {
                "path": "log-2.txt",
                "line": "working on the report",
                "meta": {"tags": ["n2", 7], "note": "the report!"},
            },
        )
    ]
    second = await ask(model, first.memory)
    assert second.plan == ["first part of the report", "second part"]
    assert second.text == "planning 2"


async def test_running_out_answers_an_empty_final_with_a_note() -> None:
    answer = await ask(model_for(SCRIPT), {SCRIPT_POSITION: 3})
    assert answer.final == ""
    assert "all 3 were played" in answer.text
    assert answer.memory[SCRIPT_POSITION] == 3
    assert answer.tool_calls == [] and answer.plan is None


async def test_a_delay_is_awaited_before_answering(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(anyio, "sleep", fake_sleep)
    model = model_for([ScriptTurn(delay=0.5, final="a"), ScriptTurn(final="b")])
    first = await ask(model, {})
    await ask(model, first.memory)
    assert slept == [0.5]


async def test_an_unresolved_script_file_is_a_definition_error() -> None:
    with pytest.raises(DefinitionError, match="not resolved"):
        ScriptedProvider().create(ModelSpec(provider="scripted", script="writer.script.toml"))


async def test_a_corrupt_position_is_a_definition_error() -> None:
    with pytest.raises(DefinitionError, match="script position"):
        await ask(model_for(SCRIPT), {SCRIPT_POSITION: "two"})
