"""``@apomesh.tool``, ``ToolSet`` and ``apomesh.Agent`` without a mesh: the schema a signature
gives, how a model's arguments reach the function, what a probe answers, the digest a tool set is
pinned at, loading ``module:object``, and an agent's definition."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import msgspec
import pytest

import apomesh
from apomesh.core.errors import DefinitionError, PluginError, ToolError
from apomesh.embedded import run_session_id
from apomesh.plugins.api import ProbeResult
from apomesh.plugins.manager import PluginHost
from apomesh.plugins.pins import pins_for
from apomesh.plugins.python_tools import PythonTool, ToolSet, load_tool_sets, tool_sets


class Place(msgspec.Struct):
    city: str


@apomesh.tool
async def forecast(
    ctx: apomesh.ToolContext,
    place: Place,
    days: Annotated[int, msgspec.Meta(description="how many days", ge=1)] = 3,
    unit: Literal["c", "f"] = "c",
) -> dict[str, Any]:
    """The weather to come."""
    return {"city": place.city, "days": days, "unit": unit, "agent": ctx.agent}


class Ctx:
    agent = "root"


def run(tool: PythonTool, args: dict[str, Any]) -> str:
    async def call() -> str:
        return await tool.run(Ctx(), args)  # type: ignore[arg-type]

    return anyio.run(call)


def test_the_schema_comes_from_the_signature_without_the_context() -> None:
    assert forecast.name == "forecast" and forecast.description == "The weather to come."
    schema = forecast.parameters
    assert schema["type"] == "object" and schema["required"] == ["place"]
    assert set(schema["properties"]) == {"place", "days", "unit"}
    assert schema["properties"]["days"] == {
        "description": "how many days",
        "type": "integer",
        "minimum": 1,
        "default": 3,
    }
    assert schema["properties"]["unit"] == {"enum": ["c", "f"], "default": "c"}
    assert schema["properties"]["place"] == {"$ref": "#/$defs/Place"}
    assert schema["$defs"]["Place"]["required"] == ["city"]
    assert schema["additionalProperties"] is False


def test_arguments_are_converted_and_a_result_that_is_no_str_is_json() -> None:
    result = run(forecast, {"place": {"city": "Oslo"}, "days": "2"})
    assert msgspec.json.decode(result) == {"city": "Oslo", "days": 2, "unit": "c", "agent": "root"}


@pytest.mark.parametrize(
    "args",
    [{}, {"place": {"city": "Oslo"}, "days": 0}, {"place": {"city": "Oslo"}, "weeks": 1}],
)
def test_arguments_that_do_not_fit_are_an_error_the_model_sees(args: dict[str, Any]) -> None:
    with pytest.raises(ToolError, match="invalid arguments for tool 'forecast'"):
        run(forecast, args)


def test_the_decorated_tool_still_calls_its_function() -> None:
    async def call() -> Any:
        return await forecast(Ctx(), Place("Rome"), days=1)

    assert anyio.run(call)["city"] == "Rome"


def test_a_sync_function_and_wrong_options_are_refused_at_decoration() -> None:
    def sync(x: int) -> int:
        return x

    async def effect(x: int) -> str:
        return ""

    async def spread(*names: str) -> str:
        return ""

    with pytest.raises(PluginError, match="must be an async function"):
        apomesh.tool(sync)
    with pytest.raises(PluginError, match="only a side_effect tool has a probe"):
        apomesh.tool(probe=effect)(effect)
    with pytest.raises(PluginError, match="on_unknown must be one of"):
        apomesh.tool(side_effect=True, on_unknown="retry")(effect)  # type: ignore[arg-type]
    with pytest.raises(PluginError, match=r"\*args and \*\*kwargs"):
        apomesh.tool(spread)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("paid", ProbeResult("happened", result="paid")),
        (None, ProbeResult("not_happened")),
        (
            ProbeResult("cannot_tell", reason="no ledger"),
            ProbeResult("cannot_tell", reason="no ledger"),
        ),
    ],
)
def test_a_probe_answers_a_str_none_or_a_probe_result(answer: Any, expected: ProbeResult) -> None:
    async def was_paid(invoice: str) -> Any:
        return answer

    @apomesh.tool(side_effect=True, on_unknown="hold", probe=was_paid)
    async def pay(invoice: str) -> str:
        return "paid"

    async def ask() -> ProbeResult:
        assert pay.probe is not None
        return await pay.probe(Ctx(), {"invoice": "A-1"})  # type: ignore[arg-type]

    assert pay.side_effect and pay.on_unknown == "hold"
    assert anyio.run(ask) == expected


def test_a_probe_answering_anything_else_is_a_tool_error() -> None:
    async def confused(invoice: str) -> Any:
        return 42

    @apomesh.tool(side_effect=True, probe=confused)
    async def pay(invoice: str) -> str:
        return "paid"

    async def ask() -> ProbeResult:
        assert pay.probe is not None
        return await pay.probe(Ctx(), {"invoice": "A-1"})  # type: ignore[arg-type]

    with pytest.raises(ToolError, match="answers a str"):
        anyio.run(ask)


def _variant(body: str, **options: Any) -> PythonTool:
    scope: dict[str, Any] = {}
    exec(f"async def act(x: int) -> str:\n    return {body!r}\n", scope)
    made: PythonTool = apomesh.tool(name="act", **options)(scope["act"])
    return made


def test_a_tool_set_is_pinned_by_module_and_a_digest_of_its_tools() -> None:
    (one,) = tool_sets([forecast])
    assert one.apomesh_plugin_name == f"python:{__name__}"
    assert one.apomesh_plugin_version == ToolSet(__name__, [forecast]).apomesh_plugin_version
    base = ToolSet("m", [_variant("a")]).apomesh_plugin_version
    assert ToolSet("m", [_variant("a")]).apomesh_plugin_version == base
    assert ToolSet("m", [_variant("b")]).apomesh_plugin_version != base  # the code changed
    assert ToolSet("m", [_variant("a", side_effect=True)]).apomesh_plugin_version != base
    assert ToolSet("m", [_variant("a"), forecast]).apomesh_plugin_version != base


def test_a_session_naming_a_python_tool_pins_its_tool_set() -> None:
    (tool_set,) = tool_sets([forecast])
    host = PluginHost.for_tests(tool_set)
    assert host.tools()["forecast"] is forecast
    pins = pins_for(host, "solo", ["forecast"], ["scripted"])
    assert (f"python:{__name__}", tool_set.apomesh_plugin_version) in {
        (p.name, p.version) for p in pins
    }


def test_module_object_names_tools_a_list_of_them_or_a_tool_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mytools.py").write_text(
        "import apomesh\n\n"
        "@apomesh.tool\nasync def one() -> str:\n    return '1'\n\n"
        "@apomesh.tool\nasync def two() -> str:\n    return '2'\n\n"
        "both = [one, two]\nnot_tools = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        (sets,) = load_tool_sets("mytools:both")
        assert sorted(sets.tools) == ["one", "two"] and sets.apomesh_plugin_name == "python:mytools"
        assert list(load_tool_sets("mytools:one")[0].tools) == ["one"]
        for spec, message in [
            ("mytools", "module:object"),
            ("nosuchmodule:x", "cannot import"),
            ("mytools:missing", "has no 'missing'"),
            ("mytools:not_tools", "is a int, not a tool"),
        ]:
            with pytest.raises(PluginError, match=message):
                load_tool_sets(spec)
    finally:
        sys.modules.pop("mytools", None)


def test_an_agent_is_a_checked_definition_naming_its_tools() -> None:
    agent = apomesh.Agent(
        "forecaster",
        instructions="Say what the weather will be.",
        tools=[forecast, "fs.read"],
        coordination="fanout",
        roles={"worker": {"tools": [forecast]}},
    )
    definition = agent.definition()
    assert definition["tools"] == ["forecast", "fs.read"]
    assert definition["roles"]["worker"]["tools"] == ["forecast"]
    with pytest.raises(DefinitionError, match="budget"):
        apomesh.Agent("x", budget={"max_stepz": 3})


def test_a_run_is_keyed_by_its_definition_and_goal_or_its_key() -> None:
    definition = apomesh.Agent("a", tools=[forecast]).definition()
    same = run_session_id(definition, "goal")
    assert same == run_session_id(dict(definition), "goal") and len(same) == 32
    assert run_session_id(definition, "other goal") != same
    assert run_session_id(definition, "goal", key="run-2") != same
    assert run_session_id({**definition, "instructions": "new"}, "goal") != same
