"""apomesh-skillpack: a skill-bundle resolver plugin for apomesh (see ``apomesh_skillpack.plugin``)."""

from __future__ import annotations

from apomesh_skillpack.plugin import PACK_PATH_ENV, SkillpackResolver

__all__ = ["PACK_PATH_ENV", "SkillpackResolver"]
