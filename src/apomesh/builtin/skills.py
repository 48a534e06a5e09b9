"""The built-in skill resolvers: a directory of skill files, and skills shipped by Python packages.

``directory`` reads ``NAME.md`` (the whole file is the body) or ``NAME.toml`` (``body = "..."``
and optionally ``tools = [...]``) from one configured directory; the runtime constructs it from
its configuration. ``entrypoint`` finds skills in the entry-point group ``apomesh.skills``: each
entry point's name is the skill name and it loads to a string body, or to a callable returning
one. Both answer a ``ResolvedSkill`` whose digest is the sha256 hex digest of the UTF-8 body.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from importlib import metadata
from pathlib import Path

import anyio.to_thread

from apomesh.core.errors import DefinitionError, PluginError
from apomesh.plugins.api import ResolvedSkill

SKILLS_ENTRY_POINT_GROUP = "apomesh.skills"

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def skill_digest(body: str) -> str:
    """The sha256 hex digest of a skill body's UTF-8 bytes (what pins record)."""
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def _check_name(skill: str) -> None:
    if not _PLAIN_NAME.match(skill) or ".." in skill:
        raise DefinitionError(f"skill name {skill!r} is not a plain name", where="skills")


class DirectorySkillResolver:
    """Skills as ``NAME.md`` or ``NAME.toml`` files in ``directory``."""

    def __init__(self, directory: Path | str, *, name: str = "directory") -> None:
        self.name = name
        self.directory = Path(directory)

    async def resolve(self, skill: str) -> ResolvedSkill | None:
        _check_name(skill)
        return await anyio.to_thread.run_sync(self._resolve_sync, skill)

    def _resolve_sync(self, skill: str) -> ResolvedSkill | None:
        markdown = self.directory / f"{skill}.md"
        toml = self.directory / f"{skill}.toml"
        if markdown.is_file() and toml.is_file():
            raise DefinitionError(
                f"skill {skill!r} exists as both {markdown.name} and {toml.name}",
                where=str(self.directory),
            )
        if markdown.is_file():
            body = _read_text(markdown)
            return ResolvedSkill(name=skill, body=body, digest=skill_digest(body))
        if toml.is_file():
            return _skill_from_toml(skill, toml)
        return None


def _read_text(path: Path) -> str:
    # Bytes, then decoded: a text-mode read would turn CRLF into LF and pin other bytes.
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise DefinitionError("a skill file must be UTF-8 text", where=str(path)) from None


def _skill_from_toml(skill: str, path: Path) -> ResolvedSkill:
    try:
        data = tomllib.loads(_read_text(path))
    except tomllib.TOMLDecodeError as exc:
        raise DefinitionError(f"not valid TOML: {exc}", where=str(path)) from None
    body = data.get("body")
    tools = data.get("tools", [])
    if not isinstance(body, str):
        raise DefinitionError("a skill file needs a string `body`", where=str(path))
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise DefinitionError("`tools` must be a list of tool names", where=str(path))
    return ResolvedSkill(name=skill, body=body, digest=skill_digest(body), tools=list(tools))


class EntryPointSkillResolver:
    """Skills shipped by installed packages under the ``apomesh.skills`` entry-point group."""

    def __init__(self, *, name: str = "entrypoint", group: str = SKILLS_ENTRY_POINT_GROUP) -> None:
        self.name = name
        self.group = group

    async def resolve(self, skill: str) -> ResolvedSkill | None:
        _check_name(skill)
        return await anyio.to_thread.run_sync(self._resolve_sync, skill)

    def _resolve_sync(self, skill: str) -> ResolvedSkill | None:
        # The same distribution seen twice on sys.path yields the same entry point twice.
        unique = {
            ep.value: ep for ep in metadata.entry_points(group=self.group) if ep.name == skill
        }
        found = list(unique.values())
        if not found:
            return None
        if len(found) > 1:
            owners = " and ".join(
                f"{ep.dist.name if ep.dist else '?'} ({ep.value})" for ep in found
            )
            raise PluginError(f"skill {skill!r} is shipped by both {owners}")
        entry_point = found[0]
        where = f"skill entry point {skill!r} = {entry_point.value}"
        try:
            loaded = entry_point.load()
            body = loaded() if callable(loaded) else loaded
        except Exception as exc:
            raise PluginError(f"{where} failed to load: {type(exc).__name__}: {exc}") from exc
        if not isinstance(body, str):
            raise PluginError(f"{where} gave a {type(body).__name__}, not a string body")
        return ResolvedSkill(name=skill, body=body, digest=skill_digest(body))
