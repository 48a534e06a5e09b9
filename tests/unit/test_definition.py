"""Agent definitions and model scripts: the documented examples parse, mistakes name their field."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from apomesh.builtin.openai_model import Credential
from apomesh.core.definition import (
    AgentDefinition,
    Budget,
    ModelSpec,
    PinnedSkill,
    RoleSpec,
    ScriptTurn,
    ToolCallSpec,
    parse_definition,
    parse_script,
    role_config,
)
from apomesh.core.errors import DefinitionError

DESIGN_DEFINITION = """
name = "writer"                 # required
version = "1.0.0"               # required to publish
instructions = "Write what you are asked."
coordination = "solo"           # solo | fanout | refine | a plugin's kind
tools = ["fs.read", "fs.append"]
skills = ["house-style"]        # resolved from the catalog unless the name says otherwise
[coordination_params]           # folded and pinned with the kind, e.g. max_parallel = 4
[model]
provider = "scripted"           # or "openai" (model, base_url, api_key_env, ...)
script = "writer.script.toml"   # path relative to this file, or inline: turns = [...]
[budget]                        # max_steps, max_tool_calls, max_tokens, max_seconds
[roles.worker]                  # per-role configuration for the sub-agents a coordinator spawns:
                                # instructions, tools, model, budget, like the top level
"""

DESIGN_SCRIPT = """
[[turns]]
delay = 0.5                     # seconds to wait before answering (optional)
tool_calls = [{ tool = "fs.append", args = { path = "log.txt", line = "step {index}" } }]
[[turns]]
plan = ["first sub-task", "second sub-task"]   # a coordinator's planning turn
[[turns]]
final = "done: {task}"          # a final answer ends the agent
"""

FANOUT_DEFINITION = """
name = "editor"
version = "2.1.0"
instructions = "Split the work and merge the parts."
coordination = "fanout"
tools = ["fs.read"]
skills = ["house-style", "citations"]
[coordination_params]
max_parallel = 4
[model]
provider = "scripted"
turns = [{ plan = ["intro", "body"] }, { final = "merged" }]
[budget]
max_steps = 10
max_tool_calls = 5
max_tokens = 20000
max_seconds = 60
[roles.worker]
instructions = "Write one section."
tools = ["fs.read", "fs.append"]
skills = ["house-style"]
budget = { max_steps = 4 }
[roles.worker.model]
provider = "scripted"
turns = [{ tool_calls = [{ tool = "fs.append", args = { path = "s.md", line = "{task}" } }] },
         { final = "done: {task}" }]
"""


def minimal(**more: Any) -> dict[str, Any]:
    return {"name": "writer", **more}


def definition_error(data: Any) -> DefinitionError:
    with pytest.raises(DefinitionError) as info:
        parse_definition(data)
    return info.value


# --- the documented examples --------------------------------------------------------------------


def test_the_design_definition_parses() -> None:
    definition = parse_definition(tomllib.loads(DESIGN_DEFINITION))
    assert (definition.name, definition.version, definition.coordination) == (
        "writer",
        "1.0.0",
        "solo",
    )
    assert definition.tools == ["fs.read", "fs.append"]
    assert definition.skills == ["house-style"]
    assert definition.coordination_params == {}
    assert definition.model == ModelSpec(provider="scripted", script="writer.script.toml")
    assert definition.budget == Budget()
    assert definition.roles == {"worker": RoleSpec()}


def test_the_design_script_parses() -> None:
    turns = parse_script(tomllib.loads(DESIGN_SCRIPT))
    assert turns == [
        ScriptTurn(
            delay=0.5,
            tool_calls=[ToolCallSpec("fs.append", {"path": "log.txt", "line": "step {index}"})],
        ),
        ScriptTurn(plan=["first sub-task", "second sub-task"]),
        ScriptTurn(final="done: {task}"),
    ]


def test_a_full_fanout_definition_parses() -> None:
    definition = parse_definition(tomllib.loads(FANOUT_DEFINITION))
    assert definition.coordination_params == {"max_parallel": 4}
    assert definition.budget == Budget(10, 5, 20000, 60.0)
    assert definition.model.turns == [
        ScriptTurn(plan=["intro", "body"]),
        ScriptTurn(final="merged"),
    ]
    worker = definition.roles["worker"]
    assert worker.budget == Budget(max_steps=4)
    assert worker.model is not None and worker.model.turns is not None
    assert worker.model.turns[0].tool_calls[0].tool == "fs.append"


def test_the_same_definition_as_json_parses_the_same() -> None:
    import json

    data = tomllib.loads(FANOUT_DEFINITION)
    assert parse_definition(json.loads(json.dumps(data))) == parse_definition(data)


def test_integers_are_accepted_where_seconds_are_expected() -> None:
    turns = parse_script({"turns": [{"delay": 2, "final": "x"}]})
    assert turns[0].delay == 2.0


def test_provider_keys_beside_provider_are_kept_as_options() -> None:
    data = minimal(
        model={
            "provider": "openai",
            "model": "gpt-x",
            "base_url": "http://127.0.0.1:9999/v1",
            "api_key_env": "OPENAI_KEY",
            "options": {"temperature": 0.2},
        },
        roles={"worker": {"model": {"provider": "openai", "api_key_env": "WORKER_KEY"}}},
    )
    definition = parse_definition(data)
    assert definition.model.model == "gpt-x"
    assert definition.model.options == {
        "base_url": "http://127.0.0.1:9999/v1",
        "api_key_env": "OPENAI_KEY",
        "temperature": 0.2,
    }
    worker_model = definition.roles["worker"].model
    assert worker_model is not None and worker_model.options == {"api_key_env": "WORKER_KEY"}
    assert parse_definition(data) == definition  # the input is not consumed


def test_a_provider_key_given_twice_is_refused() -> None:
    error = definition_error(
        minimal(model={"provider": "openai", "base_url": "a", "options": {"base_url": "b"}})
    )
    assert "$.model" in str(error) and "base_url" in str(error)


# --- mistakes name their field ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (minimal(budget={"max_steps": "many"}), "$.budget.max_steps"),
        (minimal(tools="fs.read"), "$.tools"),
        (minimal(tools=["fs.read", 3]), "$.tools[1]"),
        (minimal(version=1), "$.version"),
        (minimal(coordination_params=[1]), "$.coordination_params"),
        (
            minimal(roles={"worker": {"budget": {"max_steps": 1.5}}}),
            "$.roles.worker.budget.max_steps",
        ),
        (minimal(model={"turns": [{"final": 3}]}), "$.model.turns[0].final"),
        ({"version": "1.0.0"}, "name"),
    ],
)
def test_wrong_types_name_the_field(data: dict[str, Any], field: str) -> None:
    error = definition_error(data)
    assert field in str(error)
    assert error.where == "agent definition"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (minimal(colour="red"), "colour"),
        (minimal(budget={"max_stesp": 3}), "max_stesp"),
        (minimal(roles={"worker": {"tols": []}}), "tols"),
        (minimal(model={"turns": [{"final": "x", "finale": "y"}]}), "finale"),
    ],
)
def test_unknown_keys_are_refused_by_name(data: dict[str, Any], field: str) -> None:
    assert field in str(definition_error(data))


def test_strings_are_not_coerced_to_numbers() -> None:
    assert "$.budget.max_steps" in str(definition_error(minimal(budget={"max_steps": "5"})))


@pytest.mark.parametrize(
    ("roles", "field"),
    [
        ({"worker": {"tols": []}}, "unknown field `tols` - at `$.roles.worker`"),
        ({"a": {}, "critic": {"budget": {"max_steps": 1.5}}}, "`$.roles.critic.budget.max_steps`"),
        ({"worker": {"model": {"turns": [{"final": 1}]}}}, "`$.roles.worker.model.turns[0].final`"),
        ({"worker": "fast"}, "`$.roles.worker`"),
    ],
)
def test_role_errors_name_the_role(roles: dict[str, Any], field: str) -> None:
    assert field in str(definition_error(minimal(roles=roles)))


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_name_is_refused(name: str) -> None:
    assert "`name`" in str(definition_error({"name": name}))


@pytest.mark.parametrize("data", [None, [], "writer", 3])
def test_a_definition_must_be_a_table(data: Any) -> None:
    assert "table" in str(definition_error(data))


@pytest.mark.parametrize(
    "turn",
    [
        {"final": "x", "plan": ["a"]},
        {"final": "x", "tool_calls": [{"tool": "fs.read"}]},
        {"plan": ["a"], "tool_calls": [{"tool": "fs.read"}]},
        {"delay": 1.0},
        {"text": "thinking"},
    ],
)
def test_a_turn_needs_exactly_one_kind(turn: dict[str, Any]) -> None:
    with pytest.raises(DefinitionError, match="exactly one of") as info:
        parse_script({"turns": [{"final": "ok"}, turn]})
    assert info.value.where == "model script turn 1"


def test_a_turn_with_two_kinds_inside_a_definition_names_its_place() -> None:
    data = minimal(roles={"worker": {"model": {"turns": [{"final": "x", "plan": []}]}}})
    error = definition_error(data)
    assert error.where == "agent definition $.roles.worker.model turn 0"
    error = definition_error(minimal(model={"turns": [{"final": "a"}, {}]}))
    assert error.where == "agent definition $.model turn 1"


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(DefinitionError, match="delay"):
        parse_script({"turns": [{"delay": -1, "final": "x"}]})


@pytest.mark.parametrize("data", [{}, {"turn": []}, [], None])
def test_a_script_needs_turns(data: Any) -> None:
    with pytest.raises(DefinitionError, match="turns"):
        parse_script(data, where="writer.script.toml")


def test_script_errors_name_the_file_and_field() -> None:
    with pytest.raises(DefinitionError) as info:
        parse_script({"turns": [{"final": "x"}, {"tool_calls": [{"args": {}}]}]}, where="w.toml")
    assert info.value.where == "w.toml" and "tool" in str(info.value)
    assert "$[1].tool_calls[0]" in str(info.value)


# --- role configuration -------------------------------------------------------------------------

SKILLS = [
    PinnedSkill("house-style", "Write plainly.", "aa" * 32, "catalog"),
    PinnedSkill("citations", "Cite sources.", "bb" * 32, "catalog"),
]


def test_the_root_config_is_the_top_level() -> None:
    definition = parse_definition(tomllib.loads(FANOUT_DEFINITION))
    root = role_config(definition, "root", SKILLS)
    assert (root.name, root.version, root.role) == ("editor", "2.1.0", "root")
    assert root.instructions == definition.instructions and root.model == definition.model
    assert root.tools == ["fs.read"] and root.skills == SKILLS
    assert root.budget == definition.budget


def test_a_role_overrides_what_it_sets() -> None:
    definition = parse_definition(tomllib.loads(FANOUT_DEFINITION))
    worker = role_config(definition, "worker", SKILLS)
    assert (worker.name, worker.version, worker.role) == ("editor.worker", "2.1.0", "worker")
    assert worker.instructions == "Write one section."
    assert worker.tools == ["fs.read", "fs.append"]
    assert [s.name for s in worker.skills] == ["house-style"]
    assert worker.budget == Budget(max_steps=4)
    assert worker.model == definition.roles["worker"].model


def test_a_role_inherits_what_it_leaves_unset() -> None:
    definition = AgentDefinition(
        name="editor",
        version="1",
        instructions="top",
        tools=["fs.read"],
        budget=Budget(max_steps=7),
        affinity="gpu",
        roles={"worker": RoleSpec(instructions="mine")},
    )
    worker = role_config(definition, "worker", SKILLS)
    assert worker.instructions == "mine"
    assert (worker.tools, worker.budget, worker.model, worker.affinity) == (
        ["fs.read"],
        Budget(max_steps=7),
        definition.model,
        "gpu",
    )
    assert worker.skills == SKILLS


def test_an_undeclared_role_inherits_everything() -> None:
    definition = parse_definition(tomllib.loads(DESIGN_DEFINITION))
    reviewer = role_config(definition, "reviewer", SKILLS[:1])
    assert (reviewer.name, reviewer.role) == ("writer.reviewer", "reviewer")
    assert reviewer.instructions == definition.instructions
    assert reviewer.tools == definition.tools and reviewer.skills == SKILLS[:1]


def test_role_tool_lists_are_copies() -> None:
    definition = parse_definition(tomllib.loads(DESIGN_DEFINITION))
    root = role_config(definition, "root", [])
    root.tools.append("fs.write")
    assert definition.tools == ["fs.read", "fs.append"]


def test_a_definition_nested_deeper_than_the_limit_is_refused_naming_the_limit() -> None:
    from apomesh.core.definition import MAX_DEFINITION_DEPTH, nesting_depth

    def deep(levels: int) -> Any:
        value: Any = 1
        for _ in range(levels):
            value = [value]
        return value

    base = {"name": "deep", "model": {"provider": "scripted", "turns": [{"final": "x"}]}}
    # The definition is one table, its model another, so `extra` may hold 30 more levels.
    parse_definition({**base, "model": {**base["model"], "extra": deep(MAX_DEFINITION_DEPTH - 2)}})
    for levels in (MAX_DEFINITION_DEPTH, 5000):
        too_deep = {**base, "model": {**base["model"], "extra": deep(levels)}}
        with pytest.raises(DefinitionError, match="nest deeper than"):
            parse_definition(too_deep)
    assert nesting_depth({"a": [1, {"b": []}]}) == 4
    assert nesting_depth("text") == 0


# --- provider options -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "path", "hint"),
    [
        (
            {"provider": "openai", "model": "m", "temprature": 0.2},
            "$.model.temprature",
            "temperature",
        ),
        ({"provider": "openai", "modle": "m"}, "$.model.modle", "model"),
        ({"provider": "openai", "model": "m", "api_key_evn": "K"}, "$.model.api_key_evn", ""),
        ({"provider": "openai", "model": "m", "options": {"top-p": 1}}, "$.model.top-p", "top_p"),
        (
            {"provider": "scripted", "turns": [{"final": "x"}], "temperature": 1},
            "$.model.temperature",
            "",
        ),
    ],
)
def test_an_option_the_provider_does_not_declare_is_refused_with_its_path(
    model: dict[str, Any], path: str, hint: str
) -> None:
    from apomesh.plugins.manager import PluginHost
    from apomesh.runtime.composition import check_model_options

    host = PluginHost()
    openai = host.model_providers()["openai"]
    openai.use_credentials({"default": Credential(base_url="http://127.0.0.1:1/v1")})  # type: ignore[attr-defined]
    definition = parse_definition(minimal(model=model))
    with pytest.raises(DefinitionError) as caught:
        check_model_options(definition, host)
    assert caught.value.where == path
    if hint:
        assert f"did you mean `{hint}`" in caught.value.message
    role = parse_definition(minimal(roles={"worker": {"model": model}}))
    with pytest.raises(DefinitionError) as in_role:
        check_model_options(role, host)
    assert in_role.value.where == path.replace("$.model", "$.roles.worker.model")


def test_declared_options_and_a_retry_table_are_taken() -> None:
    from apomesh.plugins.manager import PluginHost
    from apomesh.runtime.composition import check_model_options

    host = PluginHost()
    host.model_providers()["openai"].use_credentials(  # type: ignore[attr-defined]
        {"default": Credential(base_url="http://127.0.0.1:1/v1")}
    )
    model = {
        "provider": "openai",
        "model": "m",
        "temperature": 0.2,
        "timeout": 5,
        "extra_body": {"top_k": 20},
        "retry": {"attempts": 3, "initial_delay": 0.5},
    }
    definition = parse_definition(minimal(model=model))
    check_model_options(definition, host)
    assert definition.model.retry.attempts == 3
    with pytest.raises(DefinitionError) as caught:
        parse_definition(minimal(model={**model, "retry": {"atempts": 3}}))
    assert "atempts" in caught.value.message and "$.model.retry" in caught.value.message
    with pytest.raises(DefinitionError) as negative:
        parse_definition(minimal(model={**model, "retry": {"attempts": 0}}))
    assert negative.value.where.endswith("$.model.retry.attempts")


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_stream_is_a_declared_option_of_both_http_providers(provider: str) -> None:
    from apomesh.plugins.manager import PluginHost
    from apomesh.runtime.composition import check_model_options

    host = PluginHost()
    host.model_providers()[provider].use_credentials(  # type: ignore[attr-defined]
        {"default": Credential(base_url="http://127.0.0.1:1/v1")}
    )
    model = {"provider": provider, "model": "m", "stream": True, "temperature": 0.2}
    check_model_options(parse_definition(minimal(model=model)), host)
    with pytest.raises(DefinitionError) as caught:
        check_model_options(parse_definition(minimal(model={**model, "strem": True})), host)
    assert caught.value.where == "$.model.strem"
    assert "did you mean `stream`" in caught.value.message
