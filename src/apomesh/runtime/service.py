"""The daemon as a service: ``DaemonService`` (what the REST API and the console call) on top of
the orchestrator, the catalogs and the log.

Session creation lives here: it validates the request against the configured limits, resolves the
agent (a sealed published bundle, or an inline definition whose skills are resolved now and frozen),
composes the pinned shape and makes ``SessionStarted`` durable before answering. So does moving a
stranded session to another published version of its agent (``migrate_pins`` key ``agent``): the
version's sealed bundle is read once, at the operator's request, and composed into the shape the
migration records.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import msgspec

from apomesh.core.definition import parse_definition
from apomesh.core.envelope import Envelope
from apomesh.core.errors import ApomeshError, MigrationRefused, NotFound, PayloadTooLarge
from apomesh.core.events import AgentLifecycle, PluginPin, SessionShape, SessionStarted
from apomesh.core.state import SessionState, new_state
from apomesh.core.views import (
    AgentRecordView,
    PinDiff,
    RecoverableView,
    SessionSummary,
    SessionView,
    SkillView,
    VerificationView,
    WorkerView,
    session_summary,
    session_view,
    unknown_outcomes,
)
from apomesh.plugins.pins import check_pins
from apomesh.runtime.catalog import Catalog, skill_names
from apomesh.runtime.composition import compose_shape
from apomesh.runtime.daemon import Daemon
from apomesh.runtime.folds import FoldCache
from apomesh.runtime.pinning import AGENT_PIN, agent_diff, published_agent
from apomesh.runtime.sessions import SessionRuntime
from apomesh.runtime.tails import SessionTails


def _check_size(what: str, data: Any, limit: int) -> None:
    size = len(data.encode() if isinstance(data, str) else msgspec.json.encode(data))
    if size > limit:
        raise PayloadTooLarge(what, size, limit)


class Service:
    """Implements ``apomesh.api.service.DaemonService``."""

    def __init__(self, daemon: Daemon, catalog: Catalog) -> None:
        self.daemon = daemon
        self.catalog = catalog
        self.limits = daemon.config.limits
        # Sessions this daemon does not drive (ended ones above all) are read through this cache,
        # so a request folds only what was appended since the last one, not the whole log.
        self.folds = FoldCache(daemon.log.read)
        # Every event-stream reader of a session shares one tail of its log.
        self.tails = SessionTails(daemon.log)

    # --- sessions ------------------------------------------------------------------------------------

    async def create_session(
        self,
        goal: str,
        *,
        agent: tuple[str, str | None] | None,
        definition: dict[str, Any] | None,
        by: str,
    ) -> str:
        _check_size("the goal", goal, self.limits.max_goal_bytes)
        if agent is not None:
            shape = await self._published_shape(agent[0], agent[1], check={})
        else:
            if definition is None:
                from apomesh.runtime.demo import DEFAULT_AGENT  # runtime.demo imports the node

                definition = DEFAULT_AGENT
            _check_size("the agent definition", definition, self.limits.max_definition_bytes)
            parsed = parse_definition(definition)
            skills = await self.catalog.resolve_skills(skill_names(parsed))
            shape = compose_shape(
                parsed,
                host=self.daemon.plugins,
                skills=skills,
                source="catalog" if parsed.skills else "inline",
            )
        session_id = uuid.uuid4().hex
        state = new_state(session_id)
        if not await self.daemon.kv_lease(session_id):
            raise ApomeshError(f"session {session_id} is already driven elsewhere")
        runtime = SessionRuntime(self.daemon, state)
        self.daemon.sessions[session_id] = runtime
        try:
            await runtime.append(
                SessionStarted(goal=goal, root="root", shape=shape),
                AgentLifecycle("root", "born", config=shape.root, task=goal, task_index=0),
            )
        except BaseException:
            # Nothing was written (an event over the limit, say): no session is left behind.
            self.daemon.sessions.pop(session_id, None)
            with contextlib.suppress(Exception):
                await self.daemon.kv.leases.release(session_id, self.daemon.daemon_id)
            raise
        runtime.start()
        return session_id

    async def _published_shape(
        self, name: str, version: str | None, *, check: dict[str, str] | None
    ) -> SessionShape:
        """The pinned shape of a published agent, composed from its sealed bundle alone, with the
        plugin pins it was sealed with. With ``check`` (plugin moves: name -> version) those pins,
        so moved, must be installed (``PluginPinMismatch``) before anything is composed."""
        bundle = await self.catalog.get_agent_bundle(name, version)
        parsed = parse_definition(
            bundle.definition, where=f"published agent {bundle.name}@{bundle.version}"
        )
        skills = self.catalog.bundle_skills(bundle, parsed)
        if check is not None:
            # The bundle was sealed with these plugins: running it on other code is refused.
            moved = [PluginPin(p.name, check.get(p.name, p.version)) for p in bundle.plugins]
            check_pins(self.daemon.plugins, moved)
        shape = compose_shape(
            parsed,
            host=self.daemon.plugins,
            skills=skills,
            source="published",
            agent=f"{bundle.name}@{bundle.version}",
        )
        return msgspec.structs.replace(shape, plugins=list(bundle.plugins))

    async def _migration_target(
        self, state: SessionState | None, migrate_pins: dict[str, str], *, check: bool = True
    ) -> tuple[SessionShape | None, dict[str, str]]:
        """The agent shape a ``migrate_pins`` map moves the session to (its ``agent`` entry), and
        the plugin moves left. ``NotFound`` when that version is not published."""
        plugins = {k: v for k, v in migrate_pins.items() if k != AGENT_PIN}
        version = migrate_pins.get(AGENT_PIN)
        if version is None:
            return None, plugins
        if state is None:
            raise MigrationRefused("a session that cannot be decoded cannot be migrated")
        name, _ = published_agent(state)
        shape = await self._published_shape(name, version, check=plugins if check else None)
        return shape, plugins

    async def list_sessions(
        self, *, status: str | None, query: str | None, limit: int
    ) -> list[SessionSummary]:
        rows: dict[str, SessionSummary] = {}
        for record in await self.daemon.completed_records():
            rows[record.session_id] = SessionSummary(
                session_id=record.session_id,
                status=record.status,
                goal=record.goal,
                last_index=record.last_index,
                updated_at=record.ended_at,
                side_effects=record.side_effects,
            )
        for sid, rec in self.daemon.recoverable.items():
            rows[sid] = SessionSummary(
                session_id=sid,
                status="recoverable",
                goal=rec.goal,
                last_index=rec.state.last_index if rec.state else -1,
                updated_at=rec.last_event_at,
                side_effects=rec.side_effects,
            )
        for sid, runtime in self.daemon.sessions.items():
            rows[sid] = session_summary(runtime.state)
        out = [
            r
            for r in rows.values()
            if (status is None or r.status == status)
            and (not query or query.lower() in r.goal.lower() or query.lower() in r.session_id)
        ]
        out.sort(key=lambda r: r.updated_at, reverse=True)
        return out[:limit]

    async def get_session(self, session_id: str) -> SessionView:
        rec = self.daemon.recoverable.get(session_id)
        if rec is not None:
            if rec.state is None:
                return SessionView(
                    session_id=session_id, status="recoverable", goal="", reason=rec.reason
                )
            return session_view(rec.state, status="recoverable", reason=rec.reason)
        runtime = self.daemon.sessions.get(session_id)
        if runtime is not None:
            return session_view(runtime.state)
        return await self.folds.view(session_id)

    async def read_events(self, session_id: str, after: int) -> list[Envelope]:
        envelopes: list[Envelope] = await self.daemon.log.read(session_id, after)
        if not envelopes and await self.daemon.log.last_index(session_id) < 0:
            raise NotFound(f"session {session_id}")
        return envelopes

    async def tail_events(self, session_id: str, after: int) -> AsyncIterator[Envelope]:
        async for env in self.tails.follow(session_id, after):
            yield env

    async def verify_session(self, session_id: str) -> VerificationView:
        return await self.daemon.verify(session_id)

    async def answer_hitl(self, session_id: str, pause_id: str, answer: str, *, by: str) -> None:
        await self.daemon.answer_hitl(session_id, pause_id, answer, by=by)

    async def resume(self, session_id: str, *, migrate_pins: dict[str, str], by: str) -> None:
        rec = self.daemon.recoverable.get(session_id)
        if rec is None:
            await self._not_stranded(session_id, migrate_pins)
        shape, plugins = await self._migration_target(rec.state if rec else None, migrate_pins)
        await self.daemon.resume(session_id, by=by, migrate_pins=plugins or None, agent_shape=shape)

    async def _not_stranded(self, session_id: str, migrate_pins: dict[str, str] | None) -> NoReturn:
        """404 for an unknown session, else 409: only a session on the recoverable list resumes."""
        view = await self.get_session(session_id)
        message = f"session {session_id} is {view.status}, not on the recoverable list"
        if migrate_pins:
            raise MigrationRefused(f"{message}; only a stranded session can be migrated")
        raise ApomeshError(message)

    async def recovery_preview(
        self, session_id: str, migrate_pins: dict[str, str] | None = None
    ) -> RecoverableView:
        rec = self.daemon.recoverable.get(session_id)
        if rec is None:
            await self._not_stranded(session_id, migrate_pins)
        view = self._recoverable_view(rec)
        # The preview shows the difference even when the move would be refused, and says why.
        shape, plugins = await self._migration_target(rec.state, migrate_pins or {}, check=False)
        if shape is None:
            return view
        assert rec.state is not None  # an undecodable session has no agent to move
        diff = agent_diff(self.daemon.plugins, rec.state, shape, plugins)
        return msgspec.structs.replace(view, agent_diff=diff)

    def _recoverable_view(self, rec: Any) -> RecoverableView:
        diff: list[PinDiff] = []
        outcomes = []
        if rec.state is not None:
            outcomes = unknown_outcomes(rec.state)
            if rec.state.bootstrap is not None:
                installed = self.daemon.plugins.installed_versions()
                for pin in rec.state.plugin_pins:
                    now = installed.get(pin.name)
                    if now != pin.version:
                        diff.append(PinDiff(name=pin.name, old=pin.version, new=now))
        return RecoverableView(
            session_id=rec.session_id,
            goal=rec.goal,
            reason=rec.reason,
            category=rec.category,
            side_effects=rec.side_effects,
            last_event_at=rec.last_event_at,
            unknown_outcomes=outcomes,
            pin_diff=diff,
        )

    async def cancel(self, session_id: str, *, by: str) -> None:
        await self.daemon.cancel(session_id, by=by)

    async def list_recoverable(self) -> list[RecoverableView]:
        return [self._recoverable_view(r) for r in self.daemon.recoverable.values()]

    async def list_workers(self) -> list[WorkerView]:
        now = time.monotonic()
        alive = [
            WorkerView(
                id=w.worker_id,
                name=w.name,
                last_heartbeat=w.last_beat_wall,
                agents=list(w.agents),
                tools=list(w.tools),
                providers=list(w.providers),
                alive=now - w.last_seen <= self.daemon.threshold,
            )
            for w in self.daemon.workers.values()
        ]
        lost = [
            WorkerView(
                id=w.worker_id,
                name=w.name,
                last_heartbeat=w.last_beat_wall,
                agents=[],
                tools=list(w.tools),
                providers=list(w.providers),
                alive=False,
            )
            for w in reversed(self.daemon.lost_workers.values())
            if w.worker_id not in self.daemon.workers
        ]
        return alive + lost

    # --- catalog -------------------------------------------------------------------------------------

    async def put_skill(self, name: str, body: str) -> SkillView:
        _check_size("the skill body", body, self.limits.max_skill_bytes)
        return await self.catalog.put_skill(name, body)

    async def get_skill(self, name: str) -> SkillView:
        return await self.catalog.get_skill(name)

    async def list_skills(self) -> list[SkillView]:
        return await self.catalog.list_skills()

    async def skill_history(self, name: str) -> list[SkillView]:
        return await self.catalog.skill_history(name)

    async def delete_skill(self, name: str) -> None:
        await self.catalog.delete_skill(name)

    async def publish_agent(self, definition: dict[str, Any]) -> tuple[bool, AgentRecordView]:
        _check_size("the agent definition", definition, self.limits.max_definition_bytes)
        return await self.catalog.publish_agent(definition)

    async def list_agents(self) -> list[AgentRecordView]:
        return await self.catalog.list_agents()

    async def get_agent(self, name: str, version: str | None) -> AgentRecordView:
        return await self.catalog.get_agent(name, version)

    # --- health --------------------------------------------------------------------------------------

    async def metrics_text(self) -> str:
        d = self.daemon
        m = d.metrics
        counts: dict[tuple[str, ...], float] = {}
        phases: dict[tuple[str, ...], float] = {}
        for runtime in d.sessions.values():
            key = (runtime.state.status,)
            counts[key] = counts.get(key, 0) + 1
            for agent in runtime.state.agents.values():
                phases[(agent.phase,)] = phases.get((agent.phase,), 0) + 1
        counts[("recoverable",)] = len(d.recoverable)
        m.sessions.replace(counts)
        m.agents.replace(phases)
        m.recoverable_sessions.set(len(d.recoverable))
        m.workers_alive.set(len(d.workers))
        return m.render()

    async def health(self) -> dict[str, Any]:
        d = self.daemon
        return {
            "ok": d.nc.is_connected,
            "incarnation": d.incarnation,
            "nats": "connected" if d.nc.is_connected else "reconnecting",
            "sessions": len(d.sessions),
            "recoverable": len(d.recoverable),
            "workers": len(d.workers),
            "boot": d.boot_report,
        }
