"""Agent definitions, model scripts and the resolved configuration an agent runs with.

An ``AgentDefinition`` is what a user writes (TOML, or the same as JSON); ``parse_definition`` turns
a decoded mapping into one with typed errors that name the offending field. ``AgentConfig`` is the
fully resolved, pinned configuration of one agent in a session (skills embedded, script inline):
it travels in ``SessionStarted`` and in each agent's birth event, so a resume never needs a catalog.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import msgspec

from apomesh.core.errors import DefinitionError


class ToolCallSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tool call a scripted turn asks for."""

    tool: str
    args: dict[str, Any] = {}


class ScriptTurn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One answer of the ``scripted`` model: tool calls, a plan, or a final answer."""

    delay: float = 0.0
    text: str = ""
    tool_calls: list[ToolCallSpec] = []
    plan: list[str] | None = None
    final: str | None = None
    tokens: int = 0


class ModelRetry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a model call that failed with a retryable error (a rate limit, a server error, a
    timeout, an unreachable endpoint) is tried again (``[model.retry]``): at most ``attempts``
    calls in all, waiting the API's ``Retry-After`` when it names one, else a jittered
    exponential delay from ``initial_delay`` doubling up to ``max_delay`` seconds. The agent's
    ``max_seconds`` bounds the waiting too: a wait that would overrun it is not started."""

    attempts: int = 6
    initial_delay: float = 1.0
    max_delay: float = 30.0


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Which model provider answers and how. Provider-specific keys stay in ``options``; each
    provider declares the ones it takes (``ModelProvider.options``) and any other is refused
    when a session is created."""

    provider: str = "scripted"
    model: str = ""
    script: str | None = None  # a path, resolved to ``turns`` before a session pins it
    turns: list[ScriptTurn] | None = None
    options: dict[str, Any] = {}
    retry: ModelRetry = ModelRetry()


class Budget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Ceilings for one agent; ``None`` means unlimited."""

    max_steps: int | None = 50
    max_tool_calls: int | None = None
    max_tokens: int | None = None
    max_seconds: float | None = None


class RoleSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-role configuration for the sub-agents a coordinator spawns; unset fields inherit."""

    instructions: str | None = None
    tools: list[str] | None = None
    skills: list[str] | None = None
    model: ModelSpec | None = None
    budget: Budget | None = None
    affinity: str | None = None


WorkspaceScope = Literal["session", "shared"]
"""Which directory an agent's file tools act in (``AgentDefinition.workspace``)."""


class AgentDefinition(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An agent as a user writes it (see docs/formats.md)."""

    name: str
    version: str = ""
    instructions: str = ""
    coordination: str = "solo"
    coordination_params: dict[str, Any] = {}
    tools: list[str] = []
    skills: list[str] = []
    model: ModelSpec = ModelSpec()
    budget: Budget = Budget()
    roles: dict[str, RoleSpec] = {}
    affinity: str | None = None
    description: str = ""
    workspace: WorkspaceScope = "session"
    """``session``: the session's own directory ``<workspace>/<session id>/``; ``shared``: the
    worker's whole workspace, as every session that asks for it sees it."""


class PinnedSkill(msgspec.Struct, frozen=True):
    """A skill body frozen into a session: exact bytes, their digest, and where they came from."""

    name: str
    body: str
    digest: str
    resolver: str
    tools: list[str] = []


class AgentConfig(msgspec.Struct, frozen=True):
    """The whole resolved configuration one agent runs with."""

    name: str
    version: str
    role: str
    instructions: str
    model: ModelSpec
    tools: list[str]
    skills: list[PinnedSkill]
    budget: Budget
    affinity: str | None = None
    workspace: WorkspaceScope = "shared"
    """As the definition says (its default is ``session``); a config pinned before agents had
    their own workspace decodes as ``shared``, where that session's files already are."""


_decoder_cache: dict[type, Any] = {}


def _convert(data: Any, kind: type, where: str, path: str = "$") -> Any:
    try:
        return msgspec.convert(data, kind, strict=True)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if path != "$":
            at = "- at `$"
            if at in message:
                message = message.replace(at, f"- at `{path}", 1)
            else:
                message = f"{message} - at `{path}`"
        raise DefinitionError(message, where=where) from None


MAX_DEFINITION_DEPTH = 32
"""Deepest nesting of a definition's tables and lists: every view, event and snapshot of a session
carries its definition, and each of their encoders recurses."""


_CONTAINERS = (dict, list, tuple)


def nesting_depth(data: Any) -> int:
    """How deep the dicts and lists of a decoded value nest (a scalar is 0), level by level,
    without recursing."""
    depth = 0
    level = [data] if isinstance(data, _CONTAINERS) else []
    while level:
        depth += 1
        below: list[Any] = []
        for value in level:
            children = value.values() if isinstance(value, dict) else value
            below += [child for child in children if isinstance(child, _CONTAINERS)]
        level = below
    return depth


def parse_definition(data: Any, *, where: str = "agent definition") -> AgentDefinition:
    """Validate a decoded TOML/JSON mapping as an ``AgentDefinition``.

    Raises ``DefinitionError`` naming the field (``$.budget.max_steps``) on any problem.
    """
    if not isinstance(data, dict):
        raise DefinitionError("expected a table of keys", where=where)
    if nesting_depth(data) > MAX_DEFINITION_DEPTH:
        raise DefinitionError(
            f"tables and lists nest deeper than {MAX_DEFINITION_DEPTH} levels", where=where
        )
    data = dict(data)
    if "model" in data:
        data["model"] = _lift_model_options(data["model"], f"{where} $.model")
    if isinstance(data.get("roles"), dict):
        roles = dict(data["roles"])
        for role, spec in roles.items():
            if isinstance(spec, dict) and "model" in spec:
                model = _lift_model_options(spec["model"], f"{where} $.roles.{role}.model")
                roles[role] = {**spec, "model": model}
            # Checked one by one because msgspec names a mapping's values `$.roles[...]`.
            _convert(roles[role], RoleSpec, where, f"$.roles.{role}")
        data["roles"] = roles
    definition: AgentDefinition = _convert(data, AgentDefinition, where)
    if not definition.name.strip():
        raise DefinitionError("`name` must not be empty", where=where)
    _check_script_shape(definition.model, f"{where} $.model")
    for role, spec in definition.roles.items():
        if spec.model is not None:
            _check_script_shape(spec.model, f"{where} $.roles.{role}.model")
    return definition


_MODEL_FIELDS = frozenset(ModelSpec.__struct_fields__)
MODEL_KEYS: tuple[str, ...] = tuple(k for k in ModelSpec.__struct_fields__ if k != "options")
"""The ``[model]`` keys every provider shares (the others are the provider's own options)."""


def _lift_model_options(model: Any, where: str) -> Any:
    """Move provider-specific keys written beside ``provider`` (``base_url``, ...) into ``options``.

    Without this they would be dropped silently, since ``ModelSpec`` ignores unknown keys.
    """
    if not isinstance(model, dict):
        return model
    extra = {k: v for k, v in model.items() if k not in _MODEL_FIELDS}
    options = model.get("options", {})
    if not extra or not isinstance(options, dict):
        return model
    for key in extra:
        if key in options:
            raise DefinitionError(f"`{key}` is set both here and in `options`", where=where)
    lifted = {k: v for k, v in model.items() if k in _MODEL_FIELDS}
    lifted["options"] = {**extra, **options}
    return lifted


def parse_script(data: Any, *, where: str = "model script") -> list[ScriptTurn]:
    """Validate a decoded script file (``[[turns]]``) and return its turns."""
    if not isinstance(data, dict) or "turns" not in data:
        raise DefinitionError("a script needs a `turns` list ([[turns]] tables)", where=where)
    turns: list[ScriptTurn] = _convert(data["turns"], list[ScriptTurn], where)
    for i, turn in enumerate(turns):
        _check_turn(turn, f"{where} turn {i}")
    return turns


def _check_script_shape(model: ModelSpec, where: str) -> None:
    for i, turn in enumerate(model.turns or []):
        _check_turn(turn, f"{where} turn {i}")
    retry = model.retry
    if retry.attempts < 1:
        raise DefinitionError("`attempts` must be at least 1", where=f"{where}.retry.attempts")
    for key in ("initial_delay", "max_delay"):
        if getattr(retry, key) < 0:
            raise DefinitionError(f"`{key}` must not be negative", where=f"{where}.retry.{key}")


def unknown_option(options: dict[str, Any], declared: Mapping[str, str]) -> str | None:
    """The first key of ``options`` (sorted) that ``declared`` does not name, or None."""
    return next((key for key in sorted(options) if key not in declared), None)


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice ``word`` is most likely a misspelling of, or None when none is close."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.7)
    return found[0] if found else None


def _check_turn(turn: ScriptTurn, where: str) -> None:
    kinds = sum([bool(turn.tool_calls), turn.plan is not None, turn.final is not None])
    if kinds != 1:
        raise DefinitionError(
            "a turn needs exactly one of `tool_calls`, `plan` or `final`", where=where
        )
    if turn.delay < 0:
        raise DefinitionError("`delay` must not be negative", where=where)


def role_config(definition: AgentDefinition, role: str, skills: list[PinnedSkill]) -> AgentConfig:
    """The resolved config for ``role`` ("root" or a key of ``roles``), inheriting unset fields."""
    spec = definition.roles.get(role) if role != "root" else None
    if role != "root" and spec is None:
        spec = RoleSpec()
    if spec is None:
        return AgentConfig(
            name=definition.name,
            version=definition.version,
            role="root",
            instructions=definition.instructions,
            model=definition.model,
            tools=list(definition.tools),
            skills=skills,
            budget=definition.budget,
            affinity=definition.affinity,
            workspace=definition.workspace,
        )
    wanted = set(spec.skills) if spec.skills is not None else {s.name for s in skills}
    return AgentConfig(
        name=f"{definition.name}.{role}",
        version=definition.version,
        role=role,
        instructions=spec.instructions
        if spec.instructions is not None
        else definition.instructions,
        model=spec.model if spec.model is not None else definition.model,
        tools=list(spec.tools) if spec.tools is not None else list(definition.tools),
        skills=[s for s in skills if s.name in wanted],
        budget=spec.budget if spec.budget is not None else definition.budget,
        affinity=spec.affinity if spec.affinity is not None else definition.affinity,
        workspace=definition.workspace,
    )
