"""The agent-configuration plane: the mutable skill catalog and the immutable published agents.

Skills live in the ``APOMESH_SKILLS`` KV bucket (put, get, list, history, delete). Publishing an
agent seals a bundle — the definition, the exact body of every skill it references (resolved now
and embedded), the coordination kind with its folded parameters and every plugin pin — under an
immutable ``name@version`` in the create-only ``APOMESH_AGENTS`` bucket: the same content again is
a no-op, other content is a ``PublishConflict``. A session started from a published agent reads
only the sealed bundle; one started from the catalog freezes the skill bodies it resolved.

A skill name is resolved, in this order, by the catalog, then the resolvers the runtime builds
from its configuration (the ``[skills] directory``), then the skill-resolver plugins in load
order; the first that knows the name answers its exact body and the body's sha256 digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

from apomesh.core.definition import AgentDefinition, PinnedSkill, parse_definition
from apomesh.core.errors import (
    ApomeshError,
    CatalogError,
    CorruptPin,
    DefinitionError,
    MissingSkill,
    NotFound,
    PluginError,
    PublishConflict,
)
from apomesh.core.events import PluginPin
from apomesh.core.views import AgentRecordView, SkillView
from apomesh.plugins.api import ResolvedSkill, SkillResolver
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.composition import compose_shape

CATALOG_RESOLVER = "catalog"


class SkillRecord(msgspec.Struct):
    body: str
    tools: list[str] = []


class AgentBundle(msgspec.Struct):
    """A sealed published agent."""

    name: str
    version: str
    digest: str
    definition: dict[str, Any]
    skills: list[PinnedSkill]
    coordination: str
    coordination_params: dict[str, Any]
    plugins: list[PluginPin]


_skill_decoder = msgspec.json.Decoder(SkillRecord)
_bundle_decoder = msgspec.json.Decoder(AgentBundle)


def digest_of(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def skill_names(definition: AgentDefinition) -> list[str]:
    """Every skill a definition names, at the top level and in its roles, first mention first."""
    names = list(dict.fromkeys(definition.skills))
    for _, spec in sorted(definition.roles.items()):
        names.extend(n for n in spec.skills or [] if n not in names)
    return names


def _version_key(version: str) -> tuple[Any, ...]:
    parts: list[Any] = []
    for piece in version.replace("-", ".").split("."):
        parts.append((0, int(piece), "") if piece.isdigit() else (1, 0, piece))
    return tuple(parts)


class Catalog:
    """Skills and published agents over the KV buckets (``apomesh.adapters.kv``)."""

    def __init__(
        self, kv: Any, plugins: PluginHost, resolvers: Sequence[SkillResolver] = ()
    ) -> None:
        self.kv = kv
        self.plugins = plugins
        self.resolvers = list(resolvers)  # configured ones, asked after the catalog

    # --- skills --------------------------------------------------------------------------------------

    async def put_skill(self, name: str, body: str, tools: list[str] | None = None) -> SkillView:
        _check_name(name, "skill", CatalogError)
        revision = await self.kv.skills.put(
            name, msgspec.json.encode(SkillRecord(body, tools or []))
        )
        return SkillView(name=name, body=body, digest=digest_of(body), revision=revision)

    async def get_skill(self, name: str) -> SkillView:
        got = await self.kv.skills.get_revision(name)
        if got is None:
            raise NotFound(f"skill {name}")
        data, revision = got
        record = _skill_decoder.decode(data)
        return SkillView(
            name=name, body=record.body, digest=digest_of(record.body), revision=revision
        )

    async def list_skills(self) -> list[SkillView]:
        out = []
        for name in sorted(await self.kv.skills.keys()):
            try:
                out.append(await self.get_skill(name))
            except NotFound:
                continue
        return out

    async def skill_history(self, name: str) -> list[SkillView]:
        """The kept revisions of a skill, oldest first (deletions leave no entry of their own).
        ``NotFound`` when the catalog never held the name."""
        revisions = await self.kv.skills.history(name)
        if not revisions:
            raise NotFound(f"skill {name}")
        out = []
        for rev in revisions:
            if rev.value and not rev.deleted:
                record = _skill_decoder.decode(rev.value)
                out.append(
                    SkillView(
                        name=name,
                        body=record.body,
                        digest=digest_of(record.body),
                        revision=rev.revision,
                    )
                )
        return out

    async def delete_skill(self, name: str) -> None:
        if await self.kv.skills.get(name) is None:
            raise NotFound(f"skill {name}")
        await self.kv.skills.delete(name)

    async def resolve_skill(self, name: str) -> PinnedSkill:
        """Exact bytes of one skill, from the catalog first, then the resolver plugins."""
        got = await self.kv.skills.get(name)
        if got is not None:
            record = _skill_decoder.decode(got)
            return PinnedSkill(
                name, record.body, digest_of(record.body), CATALOG_RESOLVER, list(record.tools)
            )
        for resolver in [*self.resolvers, *self.plugins.skill_resolvers()]:
            found: ResolvedSkill | None = await resolver.resolve(name)
            if found is not None:
                if digest_of(found.body) != found.digest:
                    raise PluginError(
                        f"skill resolver {resolver.name!r} answered skill {name!r} with a digest "
                        "that is not the sha256 of its body"
                    )
                return PinnedSkill(name, found.body, found.digest, resolver.name, list(found.tools))
        order = ", ".join(
            [
                "catalog",
                *(r.name for r in self.resolvers),
                *(r.name for r in self.plugins.skill_resolvers()),
            ]
        )
        raise DefinitionError(
            f"skill {name!r} was found by no resolver ({order})", where="$.skills"
        )

    async def resolve_skills(self, names: list[str]) -> list[PinnedSkill]:
        return [await self.resolve_skill(n) for n in names]

    # --- published agents ----------------------------------------------------------------------------

    async def publish_agent(self, definition: dict[str, Any]) -> tuple[bool, AgentRecordView]:
        parsed = parse_definition(definition)
        if not parsed.version:
            raise DefinitionError("publishing needs a `version`", where="$.version")
        _check_name(parsed.name, "agent")
        skills = await self.resolve_skills(skill_names(parsed))
        shape = compose_shape(
            parsed,
            host=self.plugins,
            skills=skills,
            source="published",
            agent=f"{parsed.name}@{parsed.version}",
        )
        bundle = AgentBundle(
            name=parsed.name,
            version=parsed.version,
            digest=shape.definition_digest,
            definition=msgspec.to_builtins(parsed),
            skills=skills,
            coordination=shape.coordination,
            coordination_params=shape.coordination_params,
            plugins=shape.plugins,
        )
        data = msgspec.json.encode(bundle)
        key = f"{parsed.name}@{parsed.version}"
        existing = await self.kv.agents.get(key)
        if existing is not None:
            if existing != data:
                raise PublishConflict(f"agent {key} is already published with other content")
            return False, _view(bundle)
        await self.kv.agents.create(key, data)
        return True, _view(bundle)

    async def get_agent_bundle(self, name: str, version: str | None) -> AgentBundle:
        if version is None:
            versions = [
                k.partition("@")[2]
                for k in await self.kv.agents.keys()
                if k.partition("@")[0] == name
            ]
            if not versions:
                raise NotFound(f"agent {name}")
            version = max(versions, key=_version_key)
        data = await self.kv.agents.get(f"{name}@{version}")
        if data is None:
            raise NotFound(f"agent {name}@{version}")
        return _bundle_decoder.decode(data)

    def bundle_skills(self, bundle: AgentBundle, definition: AgentDefinition) -> list[PinnedSkill]:
        """The bundle's sealed skills; a skill the definition names but the bundle lacks is fatal."""
        sealed = {s.name: s for s in bundle.skills}
        names = skill_names(definition)
        for name in names:
            if name not in sealed:
                raise MissingSkill(
                    "the sealed bundle lacks this skill",
                    pin=f"{bundle.name}@{bundle.version} skill {name}",
                )
            if digest_of(sealed[name].body) != sealed[name].digest:
                raise CorruptPin(
                    "the sealed skill body does not match its digest",
                    pin=f"{bundle.name}@{bundle.version} skill {name}",
                )
        return [sealed[n] for n in names]

    async def list_agents(self) -> list[AgentRecordView]:
        out = []
        for key in sorted(await self.kv.agents.keys()):
            name, _, version = key.partition("@")
            out.append(_view(await self.get_agent_bundle(name, version)))
        return out

    async def get_agent(self, name: str, version: str | None) -> AgentRecordView:
        return _view(await self.get_agent_bundle(name, version))


def _view(bundle: AgentBundle) -> AgentRecordView:
    return AgentRecordView(
        name=bundle.name,
        version=bundle.version,
        digest=bundle.digest,
        definition=bundle.definition,
        skills=[s.name for s in bundle.skills],
        plugins=list(bundle.plugins),
    )


def _check_name(name: str, what: str, error: type[ApomeshError] = DefinitionError) -> None:
    if not name or len(name) > 128 or any(c.isspace() or c in "@/*>" for c in name):
        raise error(
            f"{what} name {name!r} must be 1-128 characters without spaces, '@', '/', '*' or '>'"
        )
