"""Tools written as plain async Python functions, with no package: ``@tool`` and ``ToolSet``.

``@tool`` turns an async function into a ``Tool``: its name is the function's (or ``name=``), its
description the docstring, and its JSON schema comes from the signature and its annotations
(``msgspec`` types, ``Annotated[..., msgspec.Meta(description=...)]`` for a parameter's
description). A parameter annotated ``ToolContext`` receives the call's context and is not part of
the schema. The model's arguments are converted to the annotated types before the function runs;
arguments that do not fit are an error the model sees. A return value that is not a ``str`` is
sent back as JSON. ``side_effect=``, ``idempotent=`` and ``on_unknown=`` are the journal's
(``apomesh.plugins.api.Tool``); ``probe=`` is an async function with the same parameters that
answers whether the effect of a call whose outcome was lost happened: a ``str`` (it happened, with
that result), ``None`` (it did not) or a ``ProbeResult``.

Every tool ``@tool`` makes is remembered under its function's module. A ``ToolSet`` is a plugin
object (``PluginHost(extra_plugins=...)``) serving some tools under the name ``python:<module>``
and, as its version, a digest of the tools: their names, schemas, journal settings and the source
of their functions and probes. Sessions pin that (name, version) like any plugin's, so a session
resumed where the tool set changed is stranded with a pin mismatch instead of running other code.
``tool_sets`` groups tools into one set per module; ``load_tool_sets`` reads ``module:object``
(what ``apomesh worker --tools`` and ``[plugins] tools`` name).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import sys
import typing
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec

from apomesh.core.errors import PluginError, ToolError
from apomesh.plugins.api import (
    ProbeResult,
    Tool,
    ToolContext,
    UnknownOutcomePolicy,
)
from apomesh.plugins.hookspecs import hookimpl

PIN_PREFIX = "python:"
"""Plugin pins of Python tool sets are named ``python:<module>``."""

_MADE: dict[str, dict[str, PythonTool]] = {}
"""Every tool ``@tool`` made in this process, by module, then by tool name."""


class PythonTool(Tool, frozen=True):
    """A ``Tool`` made by ``@tool`` from an async function; calling it calls the function."""

    function: Callable[..., Awaitable[Any]] | None = None
    module: str = ""
    digest: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        assert self.function is not None
        return self.function(*args, **kwargs)


def _hints(function: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function, include_extras=True)
    except Exception as exc:
        raise PluginError(
            f"tool {function.__qualname__}: its annotations cannot be resolved ({exc})"
        ) from None


def _context_parameter(function: Callable[..., Any], hints: dict[str, Any]) -> str | None:
    names = [n for n, hint in hints.items() if hint is ToolContext and n != "return"]
    if len(names) > 1:
        raise PluginError(f"tool {function.__qualname__}: more than one ToolContext parameter")
    return names[0] if names else None


def _arguments_type(
    name: str, function: Callable[..., Any]
) -> tuple[type[msgspec.Struct], str | None]:
    """A msgspec struct of ``function``'s parameters (but its ``ToolContext`` one), and the name
    of that context parameter (None when it takes none)."""
    hints = _hints(function)
    context = _context_parameter(function, hints)
    fields: list[Any] = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.name == context:
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise PluginError(f"tool {name!r}: *args and **kwargs cannot be described to a model")
        hint = hints.get(parameter.name, Any)
        if parameter.default is parameter.empty:
            fields.append((parameter.name, hint))
        else:
            fields.append((parameter.name, hint, parameter.default))
    try:
        struct = msgspec.defstruct(f"{name}_arguments", fields, forbid_unknown_fields=True)
    except TypeError as exc:
        raise PluginError(f"tool {name!r}: {exc}") from None
    return struct, context


def json_schema(name: str, function: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``function``'s arguments, as a model is shown it."""
    struct, _ = _arguments_type(name, function)
    try:
        _, components = msgspec.json.schema_components([struct])
    except TypeError as exc:
        raise PluginError(f"tool {name!r}: a parameter's type has no JSON schema: {exc}") from None
    top = dict(components.pop(struct.__name__))
    top.pop("title", None)
    if components:
        top["$defs"] = components
    rebased: dict[str, Any] = _rebase_refs(top)
    return rebased


def _rebase_refs(value: Any) -> Any:
    # msgspec points at "#/components/schemas/..."; the schema here keeps them under "$defs".
    if isinstance(value, dict):
        return {
            k: (
                v.replace("#/components/schemas/", "#/$defs/")
                if k == "$ref" and isinstance(v, str)
                else _rebase_refs(v)
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_rebase_refs(v) for v in value]
    return value


def _bind(
    name: str, function: Callable[..., Awaitable[Any]]
) -> Callable[[ToolContext, dict[str, Any]], Awaitable[Any]]:
    """Calls ``function`` with the model's arguments converted to its annotated types."""
    struct, context = _arguments_type(name, function)
    fields = struct.__struct_fields__

    async def call(ctx: ToolContext, args: dict[str, Any]) -> Any:
        try:
            converted: Any = msgspec.convert(args, struct, strict=False)
        except msgspec.ValidationError as exc:
            raise ToolError(f"invalid arguments for tool {name!r}: {exc}") from None
        kwargs = {field: getattr(converted, field) for field in fields}
        if context is not None:
            kwargs[context] = ctx
        return await function(**kwargs)

    return call


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


def _as_probe_result(value: Any, name: str) -> ProbeResult:
    if isinstance(value, ProbeResult):
        return value
    if value is None:
        return ProbeResult("not_happened")
    if isinstance(value, str):
        return ProbeResult("happened", result=value)
    raise ToolError(
        f"the probe of tool {name!r} answered a {type(value).__name__}: it answers a str (the"
        " effect happened, with that result), None (it did not) or a ProbeResult"
    )


def _source_digest(function: Callable[..., Any] | None) -> str:
    if function is None:
        return ""
    try:
        text = inspect.getsource(function).encode()
    except (OSError, TypeError):
        code = getattr(function, "__code__", None)
        text = code.co_code + repr(code.co_consts).encode() if code is not None else b""
    return hashlib.sha256(text).hexdigest()


def _check_async(function: Any, what: str) -> None:
    if not inspect.iscoroutinefunction(function):
        raise PluginError(
            f"{what} {getattr(function, '__qualname__', function)!r} must be an async function"
            " (async def)"
        )


def tool(
    function: Callable[..., Awaitable[Any]] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    side_effect: bool = False,
    idempotent: bool = False,
    on_unknown: UnknownOutcomePolicy = "fail",
    probe: Callable[..., Awaitable[Any]] | None = None,
) -> Any:
    """Make an async function a tool (``@tool`` or ``@tool(side_effect=True, ...)``)."""

    def make(function: Callable[..., Awaitable[Any]]) -> PythonTool:
        _check_async(function, "a tool")
        tool_name = name or function.__name__
        if on_unknown not in typing.get_args(UnknownOutcomePolicy):
            raise PluginError(
                f"tool {tool_name!r}: on_unknown must be one of"
                f" {', '.join(typing.get_args(UnknownOutcomePolicy))}, not {on_unknown!r}"
            )
        if probe is not None:
            _check_async(probe, f"the probe of tool {tool_name!r}:")
            if not side_effect:
                raise PluginError(f"tool {tool_name!r}: only a side_effect tool has a probe")
        parameters = json_schema(tool_name, function)
        call = _bind(tool_name, function)

        async def run(ctx: ToolContext, args: dict[str, Any]) -> str:
            return _as_text(await call(ctx, args))

        run_probe = None
        if probe is not None:
            ask = _bind(f"{tool_name}.probe", probe)

            async def run_probe(ctx: ToolContext, args: dict[str, Any]) -> ProbeResult:
                return _as_probe_result(await ask(ctx, args), tool_name)

        text = description if description is not None else inspect.getdoc(function) or ""
        declared = {
            "name": tool_name,
            "description": text,
            "parameters": parameters,
            "side_effect": side_effect,
            "idempotent": idempotent,
            "on_unknown": on_unknown,
            "run": _source_digest(function),
            "probe": _source_digest(probe),
        }
        made = PythonTool(
            name=tool_name,
            description=text,
            run=run,
            parameters=parameters,
            side_effect=side_effect,
            idempotent=idempotent,
            on_unknown=on_unknown,
            probe=run_probe,
            function=function,
            module=function.__module__,
            digest=hashlib.sha256(msgspec.json.encode(declared, order="sorted")).hexdigest(),
        )
        _MADE.setdefault(made.module, {})[tool_name] = made
        return made

    return make(function) if function is not None else make


class ToolSet:
    """Python tools served as one plugin, pinned as ``python:<module>`` at the tools' digest."""

    def __init__(self, module: str, tools: Iterable[PythonTool]) -> None:
        self.tools = {t.name: t for t in tools}
        self.apomesh_plugin_name = PIN_PREFIX + module
        whole = hashlib.sha256()
        for tool_name in sorted(self.tools):
            whole.update(f"{tool_name}\0{self.tools[tool_name].digest}\0".encode())
        self.apomesh_plugin_version = whole.hexdigest()[:16]

    @hookimpl
    def register_tools(self, register: Callable[[Tool], None]) -> None:
        for made in self.tools.values():
            register(made)

    def __repr__(self) -> str:
        return f"ToolSet({self.apomesh_plugin_name}=={self.apomesh_plugin_version})"


def tool_sets(tools: Iterable[PythonTool] | None = None) -> list[ToolSet]:
    """One ``ToolSet`` per module of ``tools`` (default: every tool ``@tool`` made so far)."""
    by_module: dict[str, dict[str, PythonTool]] = {}
    chosen = (t for made in _MADE.values() for t in made.values()) if tools is None else tools
    for made in chosen:
        if not isinstance(made, PythonTool):
            raise PluginError(f"{made!r} is not a tool made by @apomesh.tool")
        by_module.setdefault(made.module, {})[made.name] = made
    return [ToolSet(module, made.values()) for module, made in sorted(by_module.items())]


def load_tool_sets(spec: str) -> list[ToolSet]:
    """The tool sets ``module:object`` names: the object is a tool, a list of tools or a
    ``ToolSet``. The module is found on ``sys.path`` and in the current directory, as
    ``python -m`` finds it. A ``PluginError`` says what is wrong with the spec."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise PluginError(f"Python tools {spec!r}: name the tools as module:object")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the module's own failure, whatever it is, named with the spec
        raise PluginError(
            f"Python tools {spec!r}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        value = getattr(module, attribute)
    except AttributeError:
        raise PluginError(
            f"Python tools {spec!r}: module {module_name} has no {attribute!r}"
        ) from None
    if isinstance(value, ToolSet):
        return [value]
    if isinstance(value, PythonTool):
        return tool_sets([value])
    if isinstance(value, list | tuple) and all(isinstance(v, PythonTool) for v in value):
        return tool_sets(value)
    raise PluginError(
        f"Python tools {spec!r}: {attribute} is a {type(value).__name__}, not a tool made by"
        " @apomesh.tool, a list of them or a ToolSet"
    )
