"""The ``skillpack`` skill resolver: skills shipped as files inside this package, and skill packs.

A skill named ``NAME`` is the file ``NAME.md``; the whole file is the body, byte for byte (read as
bytes and decoded as UTF-8, so line endings are kept). The resolver looks, in order, in each
directory of the ``APOMESH_SKILLPACK_PATH`` environment variable (``os.pathsep``-separated: packs
an operator adds, which may override a shipped skill), then in the ``skills`` directory shipped
inside this package. It answers a ``ResolvedSkill`` with the sha256 digest of the body, or None
when no file has that name, so the next resolver is asked.

apomesh resolves a skill from its catalog first, then its configured ``[skills] directory``,
then resolver plugins such as this one; the pin recorded in ``SessionStarted`` names the
resolver (``skillpack``), and a resumed session uses the pinned body, never this package's files.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path

import anyio.to_thread

from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import ResolvedSkill, SkillResolver
from apomesh.plugins.hookspecs import hookimpl

PACK_PATH_ENV = "APOMESH_SKILLPACK_PATH"
RESOLVER_NAME = "skillpack"

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def shipped_skills_dir() -> Path:
    """The directory of skills shipped inside this package."""
    return Path(str(resources.files("apomesh_skillpack") / "skills"))


class SkillpackResolver:
    """Resolves ``NAME`` to ``NAME.md`` in the pack directories, then in the shipped skills.

    ``environ`` is read at each resolve (not while registering, which does no I/O); tests pass
    their own mapping.
    """

    name = RESOLVER_NAME

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ

    def search_path(self) -> list[Path]:
        """The directories searched, in order."""
        env = os.environ if self._environ is None else self._environ
        packs = [Path(p) for p in env.get(PACK_PATH_ENV, "").split(os.pathsep) if p.strip()]
        return [*packs, shipped_skills_dir()]

    async def resolve(self, skill: str) -> ResolvedSkill | None:
        if not _PLAIN_NAME.match(skill) or ".." in skill:
            raise DefinitionError(f"skill name {skill!r} is not a plain name", where="skills")
        return await anyio.to_thread.run_sync(self._resolve_sync, skill)

    def _resolve_sync(self, skill: str) -> ResolvedSkill | None:
        for directory in self.search_path():
            path = directory / f"{skill}.md"
            if path.is_file():
                try:
                    body = path.read_bytes().decode("utf-8")
                except UnicodeDecodeError:
                    raise DefinitionError(
                        "a skill file must be UTF-8 text", where=str(path)
                    ) from None
                digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
                return ResolvedSkill(name=skill, body=body, digest=digest)
        return None


@hookimpl
def register_skill_resolvers(register: Callable[[SkillResolver], None]) -> None:
    register(SkillpackResolver())
