"""Checking a session's pinned shape before it runs again, and naming exactly what is wrong.

Every resume (a lost worker's agent, a daemon's boot scan, an operator) rebuilds a session from its
``SessionStarted`` alone and never reads the live catalog. Before it does, ``check_shape`` verifies
the record: every pinned skill body still hashes to its digest, every plugin pin is a well-formed
(name, version), and each *effective* plugin pin (those of ``SessionStarted``, moved by any
``migrate_pin`` operator action) is installed at exactly that version. A problem is a typed error
naming the pin — ``CorruptPin`` or ``PluginPinMismatch`` — never a fall-through to what the
registries hold now.

``plan_migration`` checks an operator's ``NAME=VERSION`` pin migration against the session and the
installed plugins before anything is logged. ``corrupt_bootstrap`` explains a ``SessionStarted``
that cannot be decoded at all: when the fault lies in its pinned shape it answers the
``CorruptPin`` naming the pin, so the session is listed as stranded by a pin rather than merely
undecodable.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

from apomesh.builtin.skills import skill_digest
from apomesh.core.definition import AgentConfig, PinnedSkill
from apomesh.core.errors import CorruptPin, DefinitionError, PinError, PluginPinMismatch
from apomesh.core.events import PluginPin, SessionShape
from apomesh.core.state import SessionState
from apomesh.plugins.manager import PluginHost
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


def effective_pins(
    state: SessionState, migrate: Mapping[str, str] | None = None
) -> list[PluginPin]:
    """The session's effective plugin pins, with ``migrate`` (name -> version) applied on top."""
    pins = state.plugin_pins
    if not migrate:
        return pins
    return [PluginPin(p.name, migrate.get(p.name, p.version)) for p in pins]


def check_shape(
    host: PluginHost, state: SessionState, migrate: Mapping[str, str] | None = None
) -> None:
    """Raise a ``PinError`` naming the first pin of ``state`` that cannot be satisfied now."""
    if state.bootstrap is None:
        return
    shape = state.bootstrap.shape
    check_skill_pins(shape)
    check_plugin_pin_form(shape.plugins)
    check_pins(host, effective_pins(state, migrate))


def shape_problem(host: PluginHost, state: SessionState) -> str | None:
    """``check_shape`` as a value: what is wrong with the pins, or None (what recovery
    classifiers receive as ``pin_problem``)."""
    try:
        check_shape(host, state)
    except PinError as exc:
        return exc.message
    return None


def plan_migration(
    host: PluginHost, state: SessionState, migrate: Mapping[str, str]
) -> dict[str, str]:
    """Check an operator's pin migration and answer the versions it moves from (name -> old).

    Each name must be one of the session's plugin pins and each version the one installed now;
    with the migration applied every pin must then be satisfied. Raises ``DefinitionError`` for a
    name the session does not pin, ``PluginPinMismatch`` naming the pin otherwise.
    """
    current = {p.name: p.version for p in state.plugin_pins}
    installed = host.installed_versions()
    moved_from: dict[str, str] = {}
    for name, version in sorted(migrate.items()):
        if name not in current:
            raise DefinitionError(
                f"{name!r} is not pinned by this session (its pins: "
                f"{', '.join(pin_label(p) for p in state.plugin_pins) or 'none'})",
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
    check_shape(host, state, migrate)
    return moved_from


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
