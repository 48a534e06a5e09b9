"""Composing a session's pinned shape from an agent definition.

``load_definition_file`` reads a TOML agent definition and inlines its model script files, so the
definition that reaches the daemon is self-contained. ``compose_shape`` resolves everything a
session is built from — the coordination kind and its folded parameters, each role's resolved
config, the exact skill bodies and the (name, version) of every plugin involved — into the
``SessionShape`` that ``SessionStarted`` carries. A resume rebuilds from that record alone.
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from apomesh.core.definition import (
    MODEL_KEYS,
    AgentDefinition,
    PinnedSkill,
    closest,
    parse_definition,
    parse_script,
    role_config,
    unknown_option,
)
from apomesh.core.errors import DefinitionError
from apomesh.core.events import SessionShape
from apomesh.plugins.manager import PluginHost
from apomesh.plugins.pins import pins_for


def _read_toml(path: Path, what: str) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DefinitionError(f"{what} file not found", where=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise DefinitionError(f"not valid TOML: {exc}", where=str(path)) from None


def _inline_script(model: Any, base: Path, where: str) -> Any:
    if not isinstance(model, dict) or not model.get("script") or model.get("turns"):
        return model
    script_path = (base / str(model["script"])).resolve()
    if not script_path.is_file():
        # Named by the field that points at it, so the user knows which `script` is wrong.
        raise DefinitionError(
            f"model script file {model['script']!r} not found (looked for {script_path})",
            where=f"{where}.script",
        )
    turns = parse_script(_read_toml(script_path, "model script"), where=str(script_path))
    inlined = {k: v for k, v in model.items() if k != "script"}
    inlined["turns"] = msgspec.to_builtins(turns)
    return inlined


def inline_scripts(data: dict[str, Any], base: Path, where: str) -> dict[str, Any]:
    """A definition mapping with every ``model.script`` path replaced by its inline ``turns``."""
    out = dict(data)
    if "model" in out:
        out["model"] = _inline_script(out["model"], base, f"{where} $.model")
    if isinstance(out.get("roles"), dict):
        out["roles"] = {
            role: (
                {
                    **spec,
                    "model": _inline_script(spec["model"], base, f"{where} $.roles.{role}.model"),
                }
                if isinstance(spec, dict) and "model" in spec
                else spec
            )
            for role, spec in out["roles"].items()
        }
    return out


def load_definition_file(path: Path) -> dict[str, Any]:
    """Read an agent definition TOML, inline its scripts and validate it; answers the mapping."""
    data = inline_scripts(_read_toml(path, "agent definition"), path.parent, str(path))
    parse_definition(data, where=str(path))
    return data


def definition_digest(definition: AgentDefinition) -> str:
    return hashlib.sha256(msgspec.json.encode(definition, order="sorted")).hexdigest()


def _names_skills(definition: AgentDefinition, role: str) -> bool:
    spec = definition.roles.get(role)
    return spec is not None and spec.skills is not None


def check_model_options(definition: AgentDefinition, host: PluginHost) -> None:
    """Refuse, before a session is started, a ``[model]`` key its provider does not declare
    (``ModelProvider.options``: a typo such as ``temprature`` fails here, naming its path and the
    key it was likely meant to be, instead of reaching the API), and let each provider that can
    (a ``check(spec, where)`` method, as the ``openai`` one has) refuse the values, such as a
    credential the daemon's config does not have; the worker checks again when it builds the
    model."""
    providers = host.model_providers()
    for where, model in [("$.model", definition.model)] + [
        (f"$.roles.{r}.model", s.model) for r, s in definition.roles.items() if s.model is not None
    ]:
        provider = providers.get(model.provider)
        declared: Mapping[str, str] | None = getattr(provider, "options", None)
        key = unknown_option(model.options, declared) if declared is not None else None
        if key is not None and declared is not None:
            hint = closest(key, [*declared, *MODEL_KEYS])
            known = ", ".join(sorted(declared)) or "none"
            raise DefinitionError(
                f"unknown key `{key}` for model provider {model.provider!r}"
                + (f" (did you mean `{hint}`?)" if hint else "")
                + f"; its options: {known}",
                where=f"{where}.{key}",
            )
        check = getattr(provider, "check", None)
        if callable(check):
            check(model, where)


def compose_shape(
    definition: AgentDefinition,
    *,
    host: PluginHost,
    skills: list[PinnedSkill],
    source: str,
    agent: str | None = None,
) -> SessionShape:
    """The whole resolved, pinned shape of a session started from ``definition``."""
    kinds = host.coordination_kinds()
    kind = kinds.get(definition.coordination)
    if kind is None:
        raise DefinitionError(
            f"unknown coordination kind {definition.coordination!r}; installed: {', '.join(sorted(kinds))}",
            where="$.coordination",
        )
    for where, model in [("$.model", definition.model)] + [
        (f"$.roles.{r}.model", s.model) for r, s in definition.roles.items() if s.model is not None
    ]:
        if model.script and not model.turns:
            raise DefinitionError(
                "the model script must be inlined as `turns` (load the file with the CLI)",
                where=where,
            )
    check_model_options(definition, host)
    params = kind.fold_params(dict(definition.coordination_params))
    # ``skills`` holds every skill the definition names, its roles' too; the root and the roles
    # that name none get the top-level ones only.
    top_level = [s for s in skills if s.name in definition.skills]
    root = role_config(definition, "root", top_level)
    roles = {
        role: role_config(
            definition, role, skills if _names_skills(definition, role) else top_level
        )
        for role in sorted(set(kind.roles) | set(definition.roles))
    }
    configs = [root, *roles.values()]
    tools = sorted({t for c in configs for t in c.tools} | {t for s in skills for t in s.tools})
    providers = sorted({c.model.provider for c in configs})
    plugins = pins_for(host, definition.coordination, tools, providers)
    return SessionShape(
        coordination=definition.coordination,
        coordination_params=params,
        root=root,
        roles=roles,
        skills=skills,
        plugins=plugins,
        source=source,  # type: ignore[arg-type]
        agent=agent,
        definition_digest=definition_digest(definition),
    )
