"""The plugin host, pinning, skill resolvers, the built-in classifier and the loop guard.

Third-party plugins are real distributions: a ``*.dist-info`` directory with an
``entry_points.txt`` on ``sys.path``, found through ``importlib.metadata`` like an installed one.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import apomesh
from apomesh.builtin.classifier import BuiltinRecoveryClassifier
from apomesh.builtin.coordination import COORDINATION_KINDS
from apomesh.builtin.plugin import LoopGuard
from apomesh.builtin.skills import DirectorySkillResolver, EntryPointSkillResolver, skill_digest
from apomesh.core.decisions import classify
from apomesh.core.definition import ToolCallSpec
from apomesh.core.errors import DefinitionError, NotFound, PluginError, PluginPinMismatch
from apomesh.core.events import PluginPin
from apomesh.core.state import new_state
from apomesh.plugins import hookspecs
from apomesh.plugins.api import (
    BUILTIN_CHECKPOINT_SOURCES,
    CoordinatorContext,
    Message,
    Tool,
    ToolContext,
)
from apomesh.plugins.hookspecs import hookimpl
from apomesh.plugins.manager import PluginHost
from apomesh.plugins.pins import check_pins, diff_pins, pin_problem, pins_for

Install = Callable[..., None]

BUILTIN_PIN = PluginPin("apomesh", apomesh.__version__)


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Install]:
    """Install a one-module distribution whose module is an entry point in ``group``."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def install_dist(
        dist: str,
        version: str,
        source: str,
        *,
        entry_point: str | None = None,
        group: str = "apomesh",
        target: str = "",
    ) -> None:
        module = f"fake_{dist.replace('-', '_')}"
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        value = f"{module}:{target}" if target else module
        (info / "entry_points.txt").write_text(f"[{group}]\n{entry_point or dist} = {value}\n")
        modules.append(module)
        importlib.invalidate_caches()

    yield install_dist
    for module in modules:
        sys.modules.pop(module, None)


TOOL_PLUGIN = """
from apomesh.plugins.api import Tool
from apomesh.plugins.hookspecs import hookimpl

async def echo(ctx, args):
    return args.get("text", "")

@hookimpl
def register_tools(register):
    register(Tool(name="{tool}", description="echo the text", run=echo))
"""


def tool_plugin(tool: str) -> str:
    return TOOL_PLUGIN.replace("{tool}", tool)


async def _echo(ctx: ToolContext, args: dict[str, Any]) -> str:
    return str(args)


class FakeKind:
    roles = ("worker",)

    def __init__(self, name: str) -> None:
        self.name = name

    def fold_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return params

    async def run(self, ctx: CoordinatorContext) -> str:
        return ""


class KindsPlugin:
    apomesh_plugin_name = "apomesh-kinds"
    apomesh_plugin_version = "3.1"

    def __init__(self, *names: str) -> None:
        self.names = names

    @hookimpl
    def register_coordination_kinds(self, register: Callable[[Any], None]) -> None:
        for name in self.names:
            register(FakeKind(name))


class ToolsPlugin:
    def __init__(self, name: str, version: str, *tools: str) -> None:
        self.apomesh_plugin_name = name
        self.apomesh_plugin_version = version
        self.tool_names = tools

    @hookimpl
    def register_tools(self, register: Callable[[Tool], None]) -> None:
        for tool in self.tool_names:
            register(Tool(name=tool, description="test tool", run=_echo))


class StrictClassifier:
    name = "strict"

    def classify(self, state: Any, pin_problem: str | None, tools: dict[str, Tool]) -> Any:
        return None


class ClassifierPlugin:
    apomesh_plugin_name = "apomesh-strict"

    @hookimpl
    def register_recovery_classifiers(self, register: Callable[[Any], None]) -> None:
        register(StrictClassifier())


# --- hook specifications ----------------------------------------------------------------------


def test_every_hook_spec_is_documented() -> None:
    specs = {
        name: fn
        for name, fn in vars(hookspecs).items()
        if inspect.isfunction(fn) and hasattr(fn, "apomesh_spec")
    }
    assert len(specs) == 7
    for name, fn in specs.items():
        doc = inspect.getdoc(fn) or ""
        assert name.startswith("register_"), name
        assert ":param register:" in doc, f"{name} does not document its parameter"
        assert "firstresult" in doc, f"{name} does not say whether it is firstresult"
        assert "Called" in doc, f"{name} does not say when it is called"


# --- the built-in plugin ------------------------------------------------------------------------


def test_the_builtin_plugin_registers_everything_apomesh_ships() -> None:
    host = PluginHost.for_tests()
    first = host.plugins()[0]
    assert (first.name, first.version) == ("apomesh", apomesh.__version__)
    assert set(host.tools()) == {
        "fs.read",
        "fs.list",
        "fs.write",
        "fs.append",
        "http.request",
        "ask_human",
        "checkpoint.now",
        "jobs.sleep",
    }
    assert set(host.model_providers()) == {"scripted", "openai", "anthropic"}
    assert set(host.checkpoint_sources()) == set(BUILTIN_CHECKPOINT_SOURCES)
    assert set(host.coordination_kinds()) == {kind.name for kind in COORDINATION_KINDS}
    assert list(host.supervisor_policies()) == ["loop-guard"]
    assert [c.name for c in host.recovery_classifiers()] == ["builtin"]
    assert [r.name for r in host.skill_resolvers()] == ["entrypoint"]
    assert "tools: fs.read, fs.list, fs.write, fs.append" in first.registered[4]


# --- entry points, order, allow and block lists -----------------------------------------------


def test_entry_point_plugins_load_after_the_builtin_with_distribution_and_version(
    install: Install,
) -> None:
    install("apomesh-demo", "1.2.3", tool_plugin("demo.echo"), entry_point="demo")
    host = PluginHost(allow=["apomesh-demo"], environ={})

    infos = host.plugins()
    assert [(p.name, p.version) for p in infos] == [
        ("apomesh", apomesh.__version__),
        ("apomesh-demo", "1.2.3"),
    ]
    demo = infos[1]
    assert demo.entry_point == "demo"
    assert demo.hooks == ("register_tools",)
    assert demo.registered == ("tools: demo.echo",)
    assert host.owner_of("tool", "demo.echo") == PluginPin("apomesh-demo", "1.2.3")
    assert host.owner_of("tool", "fs.read") == BUILTIN_PIN


def test_allow_and_block_lists_pick_entry_points(install: Install) -> None:
    install("plug-a", "1.0", tool_plugin("a.tool"))
    install("plug-b", "1.0", tool_plugin("b.tool"), entry_point="bee")

    only_a = PluginHost(allow=["plug-a"], environ={})
    assert "a.tool" in only_a.tools() and "b.tool" not in only_a.tools()
    assert "plug-b:bee" in only_a.skipped()

    by_env = PluginHost(
        environ={"APOMESH_PLUGINS_ALLOW": "plug-a, plug-b", "APOMESH_PLUGINS_BLOCK": "bee"}
    )
    assert "a.tool" in by_env.tools() and "b.tool" not in by_env.tools()

    argument_wins = PluginHost(allow=["bee"], environ={"APOMESH_PLUGINS_ALLOW": "plug-a"})
    assert "b.tool" in argument_wins.tools() and "a.tool" not in argument_wins.tools()

    blocked = PluginHost(allow=["plug-a", "plug-b"], block=["plug-a"], environ={})
    assert "b.tool" in blocked.tools() and "a.tool" not in blocked.tools()


def test_an_entry_point_that_fails_to_import_is_a_plugin_error(install: Install) -> None:
    install("plug-broken", "0.3", "import no_such_module_anywhere\n")
    with pytest.raises(PluginError, match=r"plug-broken 0\.3 .*failed to load"):
        PluginHost(allow=["plug-broken"], environ={})


# --- collisions and contract checks ------------------------------------------------------------


def test_a_name_collision_with_the_builtin_plugin_names_both_plugins() -> None:
    with pytest.raises(PluginError) as caught:
        PluginHost.for_tests(ToolsPlugin("my-fs", "2.0", "fs.read"))
    message = str(caught.value)
    assert "'fs.read'" in message
    assert f"apomesh {apomesh.__version__}" in message
    assert "my-fs 2.0" in message


def test_a_name_collision_between_entry_point_plugins_names_both(install: Install) -> None:
    install("plug-one", "1.0", tool_plugin("shared.tool"))
    install("plug-two", "2.0", tool_plugin("shared.tool"))
    with pytest.raises(PluginError, match=r"plug-one 1\.0.*plug-two 2\.0"):
        PluginHost(allow=["plug-one", "plug-two"], environ={})


def test_a_misspelt_hook_implementation_fails_loudly() -> None:
    class Misspelt:
        apomesh_plugin_name = "apomesh-typo"

        @hookimpl
        def register_tool(self, register: Callable[[Tool], None]) -> None:
            raise AssertionError("never called")

    with pytest.raises(PluginError, match=r"apomesh-typo.*register_tool"):
        PluginHost.for_tests(Misspelt())


def test_a_hook_implementation_with_a_wrong_argument_fails_loudly() -> None:
    class WrongArgument:
        apomesh_plugin_name = "apomesh-wrong-arg"

        @hookimpl
        def register_tools(self, registrar: Callable[[Tool], None]) -> None:
            raise AssertionError("never called")

    with pytest.raises(PluginError, match="apomesh-wrong-arg"):
        PluginHost.for_tests(WrongArgument())


def test_an_async_hook_implementation_is_refused() -> None:
    class AsyncHook:
        apomesh_plugin_name = "apomesh-async"

        @hookimpl
        async def register_tools(self, register: Callable[[Tool], None]) -> None:
            raise AssertionError("never awaited")

    with pytest.raises(PluginError, match="must not be async"):
        PluginHost.for_tests(AsyncHook())


def test_registering_the_wrong_type_is_refused() -> None:
    class NotATool:
        apomesh_plugin_name = "apomesh-bad"

        @hookimpl
        def register_tools(self, register: Callable[[Any], None]) -> None:
            register({"name": "x.tool"})

    with pytest.raises(PluginError, match=r"apomesh-bad.*not a Tool"):
        PluginHost.for_tests(NotATool())


def test_registering_after_the_hook_returned_is_refused() -> None:
    stash: list[Callable[[Any], None]] = []

    class Late:
        apomesh_plugin_name = "apomesh-late"

        @hookimpl
        def register_model_providers(self, register: Callable[[Any], None]) -> None:
            stash.append(register)

    PluginHost.for_tests(Late())
    with pytest.raises(PluginError, match="after register_model_providers returned"):
        stash[0](object())


# --- registries and introspection --------------------------------------------------------------


def test_third_party_recovery_classifiers_are_asked_before_the_builtin_one() -> None:
    host = PluginHost.for_tests(ClassifierPlugin())
    assert [c.name for c in host.recovery_classifiers()] == ["strict", "builtin"]


def test_plugins_reports_what_each_plugin_registered() -> None:
    host = PluginHost.for_tests(KindsPlugin("chain", "vote"))
    info = host.plugins()[-1]
    assert (info.name, info.version) == ("apomesh-kinds", "3.1")
    assert info.hooks == ("register_coordination_kinds",)
    assert info.registered == ("coordination: chain, vote",)
    assert {"chain", "vote"} <= set(host.coordination_kinds())


def test_owner_of_an_unknown_name_is_not_found() -> None:
    with pytest.raises(NotFound, match=r"no\.such"):
        PluginHost.for_tests().owner_of("tool", "no.such")


# --- pins ----------------------------------------------------------------------------------------


def test_pins_for_names_each_owning_plugin_once_sorted() -> None:
    host = PluginHost.for_tests(KindsPlugin("chain"), ToolsPlugin("apomesh-extra", "1.0", "x.y"))
    pins = pins_for(host, "chain", ["fs.read", "x.y", "fs.write"], ["scripted", "scripted"])
    assert pins == [
        BUILTIN_PIN,
        PluginPin("apomesh-extra", "1.0"),
        PluginPin("apomesh-kinds", "3.1"),
    ]


def test_pins_for_an_unknown_tool_is_a_definition_error() -> None:
    host = PluginHost.for_tests()
    with pytest.raises(DefinitionError, match=r"unknown tool 'fs\.reed'.*fs\.read"):
        pins_for(host, next(iter(host.coordination_kinds()), "solo"), ["fs.reed"], [])


def test_check_pins_accepts_installed_versions_and_names_a_mismatch() -> None:
    host = PluginHost.for_tests(ToolsPlugin("apomesh-extra", "1.0", "x.y"))
    check_pins(host, [BUILTIN_PIN, PluginPin("apomesh-extra", "1.0")])

    with pytest.raises(PluginPinMismatch, match=r"apomesh-extra==0\.9.*installed at version 1\.0"):
        check_pins(host, [PluginPin("apomesh-extra", "0.9")])
    with pytest.raises(PluginPinMismatch, match=r"apomesh-gone==1\.0.*not installed") as caught:
        check_pins(host, [PluginPin("apomesh-gone", "1.0")])
    assert caught.value.pin == "apomesh-gone==1.0"
    assert pin_problem(host, [PluginPin("apomesh-gone", "1.0")]) == caught.value.message
    assert pin_problem(host, [BUILTIN_PIN]) is None


def test_diff_pins_lists_added_removed_and_changed_plugins() -> None:
    old = [PluginPin("a", "1.0"), PluginPin("b", "1.0"), PluginPin("c", "1.0")]
    new = [PluginPin("a", "1.0"), PluginPin("b", "2.0"), PluginPin("d", "0.1")]
    assert [str(change) for change in diff_pins(old, new)] == [
        "~ b 1.0 -> 2.0",
        "- c==1.0",
        "+ d==0.1",
    ]
    assert diff_pins(old, old) == []


# --- built-in classifier and supervisor policy -------------------------------------------------


def test_the_builtin_classifier_is_the_core_rules_exactly() -> None:
    state = new_state("s-1")
    classifier = BuiltinRecoveryClassifier()
    assert classifier.name == "builtin"
    assert classifier.classify(state, None, {}) == classify(state, None)
    assert classifier.classify(state, "x==1 missing", {}) == classify(state, "x==1 missing")


def _calls(*args: dict[str, Any]) -> Message:
    return Message(role="assistant", tool_calls=[ToolCallSpec("fs.read", a) for a in args])


def test_loop_guard_resets_after_four_identical_tool_calls() -> None:
    guard = LoopGuard()
    same = _calls({"path": "a.txt"})
    result = Message(role="tool", content="nothing new")
    three = [same, result, same, result, same, result]
    assert guard.review("root", 3, three) == "continue"
    assert guard.review("root", 4, [*three, same]) == "reset"
    # Argument order does not make two calls different.
    reordered = Message(
        role="assistant", tool_calls=[ToolCallSpec("fs.read", {"b": 1, "path": "a.txt"})]
    )
    same_two_keys = _calls({"path": "a.txt", "b": 1})
    assert guard.review("root", 4, [same_two_keys] * 3 + [reordered]) == "reset"


def test_loop_guard_continues_when_calls_differ_or_a_turn_had_none() -> None:
    guard = LoopGuard()
    same = _calls({"path": "a.txt"})
    assert guard.review("root", 4, [same, same, same, _calls({"path": "b.txt"})]) == "continue"
    assert guard.review("root", 4, [same, same, same, Message(role="assistant")]) == "continue"


# --- skill resolvers -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_directory_resolver_reads_markdown_and_toml_skills(tmp_path: Path) -> None:
    (tmp_path / "house-style.md").write_text("Write plainly.\n")
    (tmp_path / "logger.toml").write_text('body = "Log every step."\ntools = ["fs.append"]\n')
    resolver = DirectorySkillResolver(tmp_path)

    style = await resolver.resolve("house-style")
    assert style is not None
    assert (style.body, style.digest) == ("Write plainly.\n", skill_digest("Write plainly.\n"))
    logger = await resolver.resolve("logger")
    assert logger is not None
    assert (logger.body, logger.tools) == ("Log every step.", ["fs.append"])
    assert await resolver.resolve("missing") is None


@pytest.mark.anyio
async def test_directory_resolver_refuses_ambiguous_bad_and_unsafe_skills(tmp_path: Path) -> None:
    (tmp_path / "twice.md").write_text("a")
    (tmp_path / "twice.toml").write_text('body = "b"')
    (tmp_path / "broken.toml").write_text("body = ")
    resolver = DirectorySkillResolver(tmp_path)
    with pytest.raises(DefinitionError, match="both"):
        await resolver.resolve("twice")
    with pytest.raises(DefinitionError, match="TOML"):
        await resolver.resolve("broken")
    with pytest.raises(DefinitionError, match="plain name"):
        await resolver.resolve("../etc/passwd")


@pytest.mark.anyio
async def test_entrypoint_resolver_loads_bodies_and_callables(install: Install) -> None:
    install(
        "skills-pkg",
        "1.0",
        'STYLE = "Be brief."\ndef make():\n    return "Made body."\n',
        entry_point="brief",
        group="apomesh.skills",
        target="STYLE",
    )
    install(
        "skills-pkg2",
        "1.0",
        'def make():\n    return "Made body."\n',
        entry_point="made",
        group="apomesh.skills",
        target="make",
    )
    resolver = EntryPointSkillResolver()
    brief = await resolver.resolve("brief")
    assert brief is not None
    assert (brief.body, brief.digest) == ("Be brief.", skill_digest("Be brief."))
    made = await resolver.resolve("made")
    assert made is not None and made.body == "Made body."
    assert await resolver.resolve("not-shipped") is None
