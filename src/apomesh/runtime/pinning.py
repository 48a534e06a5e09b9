"""Checking a session's pinned shape before it runs again, and naming exactly what is wrong.

Every resume (a lost worker's agent, a daemon's boot scan, an operator) rebuilds a session from its
``SessionStarted`` alone and never reads the live catalog. Before it does, ``check_shape`` verifies
the record: every pinned skill body still hashes to its digest, every plugin pin is a well-formed
(name, version), and each *effective* plugin pin (those of ``SessionStarted``, moved by any
``migrate_pin`` operator action) is installed at exactly that version. A problem is a typed error
naming the pin — ``CorruptPin`` or ``PluginPinMismatch`` — never a fall-through to what the
registries hold now.

``plan_migration`` checks an operator's ``NAME=VERSION`` pin migration against the session and the
installed plugins before anything is logged; ``plan_agent_migration`` checks a move to another
published version of the session's agent (``--migrate-pin agent=VERSION``: same agent, same
coordination kind, every agent still running has its role in the new version) and
``agent_diff`` shows the operator what that move changes. ``corrupt_bootstrap`` explains a
``SessionStarted``
that cannot be decoded at all: when the fault lies in its pinned shape it answers the
``CorruptPin`` naming the pin, so the session is listed as stranded by a pin rather than merely
undecodable. ``worker_pins`` are the pins a worker must satisfy to run one agent: those of the
plugins whose code runs there (its tools and model provider).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

from apomesh.builtin.skills import skill_digest
from apomesh.core.definition import AgentConfig, PinnedSkill
from apomesh.core.errors import (
    CorruptPin,
    DefinitionError,
    MigrationRefused,
    NotFound,
    PinError,
    PluginPinMismatch,
)
from apomesh.core.events import PluginPin, SessionShape
from apomesh.core.state import SessionState
from apomesh.core.views import AgentDiff, PinChange, SkillChange
from apomesh.plugins.manager import PluginHost, RegistryKind
from apomesh.plugins.pins import check_pins, pin_label


def _configs(shape: SessionShape) -> Iterator[tuple[str, AgentConfig]]:
    yield "root", shape.root
    for role, config in sorted(shape.roles.items()):
        yield f"role {role}", config


def pinned_skills(shape: SessionShape) -> Iterator[tuple[str, PinnedSkill]]:
    """Every pinned skill of a shape with a label naming where it sits (``skill tone``,
    ``role worker skill tone``)."""
    for skill in shape.skills:
        yield f"skill {skill.name}", skill
    for where, config in _configs(shape):
        for skill in config.skills:
            yield f"{where} skill {skill.name}", skill


def check_skill_pins(shape: SessionShape) -> None:
    """``CorruptPin`` for the first pinned skill whose body does not hash to its digest."""
    for label, skill in pinned_skills(shape):
        if not skill.name or skill_digest(skill.body) != skill.digest:
            raise CorruptPin(
                f"the pinned body does not match its digest {skill.digest[:12] or '(none)'}",
                pin=label,
            )


def check_plugin_pin_form(pins: list[PluginPin]) -> None:
    """``CorruptPin`` for a plugin pin without a name or a version."""
    for i, pin in enumerate(pins):
        if not pin.name.strip() or not pin.version.strip():
            raise CorruptPin(
                "a plugin pin needs a distribution name and a version", pin=f"plugins[{i}]"
            )


AGENT_PIN = "agent"
"""The ``--migrate-pin`` name that moves a session to another version of its published agent."""


def effective_pins(
    state: SessionState,
    migrate: Mapping[str, str] | None = None,
    shape: SessionShape | None = None,
) -> list[PluginPin]:
    """The session's effective plugin pins, with ``migrate`` (name -> version) applied on top;
    with ``shape`` (an agent version it moves to), that shape's sealed pins instead."""
    pins = state.plugin_pins if shape is None else list(shape.plugins)
    if not migrate:
        return pins
    return [PluginPin(p.name, migrate.get(p.name, p.version)) for p in pins]


def check_shape(
    host: PluginHost,
    state: SessionState,
    migrate: Mapping[str, str] | None = None,
    shape: SessionShape | None = None,
) -> None:
    """Raise a ``PinError`` naming the first pin of ``state``'s effective shape (or of ``shape``,
    an agent version it moves to) that cannot be satisfied now."""
    checked = shape if shape is not None else state.effective_shape
    if checked is None:
        return
    check_skill_pins(checked)
    check_plugin_pin_form(checked.plugins)
    check_pins(host, effective_pins(state, migrate, shape))


def shape_problem(host: PluginHost, state: SessionState) -> str | None:
    """``check_shape`` as a value: what is wrong with the pins, or None (what recovery
    classifiers receive as ``pin_problem``)."""
    try:
        check_shape(host, state)
    except PinError as exc:
        return exc.message
    return None


def plan_migration(
    host: PluginHost,
    state: SessionState,
    migrate: Mapping[str, str],
    shape: SessionShape | None = None,
) -> dict[str, str]:
    """Check an operator's pin migration and answer the versions it moves from (name -> old).

    Each name must be one of the session's plugin pins (of ``shape`` when the session also moves
    to that agent version) and each version the one installed now; with the migration applied
    every pin must then be satisfied. Raises ``DefinitionError`` for a name the session does not
    pin, ``PluginPinMismatch`` naming the pin otherwise.
    """
    pinned = state.plugin_pins if shape is None else list(shape.plugins)
    current = {p.name: p.version for p in pinned}
    installed = host.installed_versions()
    moved_from: dict[str, str] = {}
    for name, version in sorted(migrate.items()):
        if name not in current:
            raise DefinitionError(
                f"{name!r} is not pinned by this session (its pins: "
                f"{', '.join(pin_label(p) for p in pinned) or 'none'})",
                where="migrate_pins",
            )
        label = f"{name}=={current[name]}"
        now = installed.get(name)
        if now is None:
            raise PluginPinMismatch(
                f"cannot migrate to {version}: the plugin is not installed", pin=label
            )
        if now != version:
            raise PluginPinMismatch(
                f"cannot migrate to {version}: the plugin is installed at version {now}",
                pin=label,
            )
        moved_from[name] = current[name]
    check_shape(host, state, migrate, shape)
    return moved_from


def published_agent(state: SessionState) -> tuple[str, str]:
    """(name, version) of the published agent the session runs now; ``MigrationRefused`` when it
    was not started from a published agent."""
    shape = state.effective_shape
    if shape is None:
        raise MigrationRefused(
            f"session {state.session_id} has no durable SessionStarted; it cannot be migrated"
        )
    name, sep, version = (shape.agent or "").partition("@")
    if shape.source != "published" or not sep:
        raise MigrationRefused(
            f"session {state.session_id} was not started from a published agent (it was "
            f"composed from {shape.source!r}); only a published agent can move to another version"
        )
    return name, version


def plan_agent_migration(
    host: PluginHost,
    state: SessionState,
    shape: SessionShape,
    migrate: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Check moving ``state`` to ``shape`` (another published version of its agent) and answer
    the ``migrate_pin`` detail that records it, the new shape embedded.

    Raises ``MigrationRefused`` for a session not started from a published agent, another agent,
    the version it runs already, a changed coordination kind, or a role an unfinished agent has
    that the new version lacks; a ``PinError`` naming the first pin of the new shape (with
    ``migrate``'s plugin moves) that cannot be satisfied."""
    name, version = published_agent(state)
    current = state.effective_shape
    assert current is not None
    new_name, _, new_version = (shape.agent or "").partition("@")
    if shape.source != "published" or new_name != name:
        raise MigrationRefused(f"a session of {name} cannot move to {shape.agent or 'that shape'}")
    if new_version == version:
        raise MigrationRefused(f"session {state.session_id} runs {name}@{version} already")
    if shape.coordination != current.coordination:
        raise MigrationRefused(
            f"{name}@{new_version} coordinates with {shape.coordination!r}, not "
            f"{current.coordination!r} as this session does; a migration keeps the coordination "
            "kind"
        )
    for agent in state.agents.values():
        config = agent.current_config
        if agent.terminal or config is None or config.role == "root":
            continue
        if config.role not in shape.roles:
            raise MigrationRefused(
                f"{name}@{new_version} has no role {config.role!r}, which agent {agent.ref} "
                "still runs as"
            )
    moved_from = plan_migration(host, state, migrate or {}, shape)
    return {
        "pins": dict(migrate or {}),
        "from": moved_from,
        "agent": {"from": f"{name}@{version}", "to": shape.agent},
        "shape": msgspec.to_builtins(shape),
    }


def agent_diff(
    host: PluginHost,
    state: SessionState,
    shape: SessionShape,
    migrate: Mapping[str, str] | None = None,
) -> AgentDiff:
    """What moving ``state`` to ``shape`` changes, and why the move would be refused, if so."""
    old = state.effective_shape
    assert old is not None
    problem: str | None = None
    try:
        plan_agent_migration(host, state, shape, migrate)
    except (MigrationRefused, PinError, DefinitionError) as exc:
        problem = exc.message
    old_skills = {s.name: s.digest for s in old.skills}
    new_skills = {s.name: s.digest for s in shape.skills}
    old_pins = {p.name: p.version for p in state.plugin_pins}
    new_pins = {p.name: p.version for p in effective_pins(state, migrate, shape)}
    old_configs = {"root": old.root, **old.roles}
    new_configs = {"root": shape.root, **shape.roles}
    return AgentDiff(
        old=old.agent or "",
        new=shape.agent or "",
        old_digest=old.definition_digest,
        new_digest=shape.definition_digest,
        coordination=(old.coordination, shape.coordination),
        coordination_params=(dict(old.coordination_params), dict(shape.coordination_params)),
        skills=[
            SkillChange(name=n, old=old_skills.get(n), new=new_skills.get(n))
            for n in sorted(old_skills.keys() | new_skills.keys())
            if old_skills.get(n) != new_skills.get(n)
        ],
        plugins=[
            PinChange(name=n, old=old_pins.get(n), new=new_pins.get(n))
            for n in sorted(old_pins.keys() | new_pins.keys())
            if old_pins.get(n) != new_pins.get(n)
        ],
        roles=[
            role
            for role in sorted(old_configs.keys() | new_configs.keys())
            if _comparable(old_configs.get(role)) != _comparable(new_configs.get(role))
        ],
        problem=problem,
    )


def _comparable(config: AgentConfig | None) -> Any:
    # The version always differs between two versions; a role changed when anything else did.
    return None if config is None else msgspec.structs.replace(config, version="")


def corrupt_bootstrap(raw: bytes) -> CorruptPin | None:
    """Why an undecodable ``SessionStarted`` entry fails, when it is one of its pins.

    ``raw`` is the stored bytes of a session's first entry. Answers the ``CorruptPin`` naming the
    first pin (a plugin pin, a pinned skill, or the part of the shape at fault) that cannot be
    decoded, or None when the entry is not a ``SessionStarted`` or its shape decodes.
    """
    try:
        entry = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    if not isinstance(entry, list) or len(entry) != 6 or not isinstance(entry[5], dict):
        return None
    event: dict[str, Any] = entry[5]
    if event.get("kind") != "SessionStarted":
        return None
    shape = event.get("shape")
    if not isinstance(shape, dict):
        return CorruptPin("the pinned shape is not a table", pin="shape")
    plugins = shape.get("plugins")
    if not isinstance(plugins, list):
        return CorruptPin("the plugin pins are not a list", pin="plugins")
    for i, item in enumerate(plugins):
        problem = _convert_problem(item, PluginPin)
        if problem is not None:
            name = item.get("name") if isinstance(item, dict) else None
            label = f"plugin {name}" if isinstance(name, str) and name else f"plugins[{i}]"
            return CorruptPin(f"undecodable plugin pin: {problem}", pin=label)
    skills = shape.get("skills")
    if not isinstance(skills, list):
        return CorruptPin("the skill pins are not a list", pin="skills")
    for i, item in enumerate(skills):
        problem = _convert_problem(item, PinnedSkill)
        if problem is not None:
            name = item.get("name") if isinstance(item, dict) else None
            label = f"skill {name}" if isinstance(name, str) and name else f"skills[{i}]"
            return CorruptPin(f"undecodable skill pin: {problem}", pin=label)
    problem = _convert_problem(shape, SessionShape)
    if problem is not None:
        path = problem.rpartition(" - at ")[2].strip("`") if " - at " in problem else "shape"
        return CorruptPin(f"undecodable pinned shape: {problem}", pin=path)
    return None


def _convert_problem(value: Any, kind: type) -> str | None:
    try:
        msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        return str(exc)
    return None


def worker_pins(plugins: PluginHost, pins: list[PluginPin], config: AgentConfig) -> list[PluginPin]:
    """The session's ``pins`` a worker must satisfy to run an agent with ``config``: those of the
    plugins that own its tools (a skill's too) and its model provider, whose code runs on the
    worker. A plugin that runs on the daemon alone (a coordination kind's) is not the worker's."""
    owners: set[str] = set()
    wanted: list[tuple[RegistryKind, str]] = [("model_provider", config.model.provider)]
    wanted += [("tool", t) for t in config.tools]
    wanted += [("tool", t) for skill in config.skills for t in skill.tools]
    for kind, name in wanted:
        try:
            owners.add(plugins.owner_of(kind, name).name)
        except NotFound:
            continue
    return [pin for pin in pins if pin.name in owners]
