"""The daemon as a service: ``DaemonService`` (what the REST API and the console call), the one
application facade over the session registry, the worker pool, the catalogs and the log.

Every use case lives here: create, answer a pause, resume (with a migration), cancel, and the
reads. A use case that changes a session does it through the session's single writer
(``SessionRuntime.decide``), opened through the registry; it never touches a writer's internals.
Session creation validates the request against the configured limits, resolves the
agent (a sealed published bundle, or an inline definition whose skills are resolved now and frozen),
composes the pinned shape and makes ``SessionStarted`` durable before answering; with an
``Idempotency-Key`` the key is stored first (``idempotency`` records), so a retry, here or after a
restart, answers the same session. An ended session is purged through ``runtime.retention``. So does moving a
stranded session to another published version of its agent (``migrate_pins`` key ``agent``): the
version's sealed bundle is read once, at the operator's request, and composed into the shape the
migration records.

Several daemons may serve one NATS: a new session is placed on the daemon that received the
request (refused with ``DaemonDraining`` while it drains); any daemon answers the reads of any
session (the fold over the log); a write to a session another daemon owns (its lease, or its
recoverable list) is refused with ``OwnedElsewhere`` naming that daemon and its URL, never
applied here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import msgspec

from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.builtin.agents import DEFAULT_AGENT
from apomesh.core import decisions
from apomesh.core.definition import parse_definition
from apomesh.core.envelope import Envelope
from apomesh.core.errors import (
    ApomeshError,
    CommandRefused,
    DaemonDraining,
    IdempotencyConflict,
    MigrationRefused,
    NotFound,
    OwnedElsewhere,
    PayloadTooLarge,
)
from apomesh.core.events import (
    AgentLifecycle,
    Event,
    OperatorAction,
    PluginPin,
    SessionShape,
    SessionStarted,
)
from apomesh.core.ports import EventLog
from apomesh.core.state import SessionState, new_state
from apomesh.core.views import (
    AgentConversation,
    AgentRecordView,
    AgentSummary,
    DaemonView,
    PendingPauseView,
    PinDiff,
    RecoverableFilter,
    RecoverableView,
    ResumeOutcome,
    SessionSummary,
    SessionView,
    SkillView,
    VerificationView,
    WorkerView,
    session_summary,
    session_view,
    unknown_outcomes,
)
from apomesh.plugins.manager import PluginHost
from apomesh.plugins.pins import check_pins
from apomesh.runtime.catalog import Catalog, skill_names
from apomesh.runtime.composition import compose_shape
from apomesh.runtime.config import LimitsConfig
from apomesh.runtime.conversation import load_conversation
from apomesh.runtime.live_deltas import LiveDeltas
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.pinning import (
    AGENT_PIN,
    agent_diff,
    check_shape,
    plan_agent_migration,
    plan_migration,
    published_agent,
)
from apomesh.runtime.presence import Presence
from apomesh.runtime.protocol import TurnDelta
from apomesh.runtime.registry import (
    IDEMPOTENCY_DB,
    IdempotencyRecord,
    Recoverable,
    SessionRegistry,
)
from apomesh.runtime.retention import Retention
from apomesh.runtime.sessions import Ending
from apomesh.runtime.tails import SessionTails
from apomesh.runtime.workers import WorkerPool

NEEDS_A_WORKER = frozenset({"born", "dispatched", "running"})
"""Agent phases in which an agent runs on (or waits for) a worker."""
BULK_RESUME_CONCURRENCY = 32
"""How many sessions a bulk resume (``resume_matching``) resumes at once."""


class KeyedLocks:
    """One asyncio lock per key, kept only while someone holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


def _check_size(what: str, data: Any, limit: int) -> None:
    size = len(data.encode() if isinstance(data, str) else msgspec.json.encode(data))
    if size > limit:
        raise PayloadTooLarge(what, size, limit)


class Service:
    """Implements ``apomesh.api.service.DaemonService``."""

    def __init__(
        self,
        *,
        registry: SessionRegistry,
        workers: WorkerPool,
        plugins: PluginHost,
        log_adapter: EventLog,
        store: AsyncStore,
        catalog: Catalog,
        limits: LimitsConfig,
        metrics: DaemonMetrics,
        nc: Any,
        incarnation: str,
        boot_report: Callable[[], dict[str, Any]],
        presence: Presence | None = None,
        request_drain: Callable[[str], Awaitable[None]] | None = None,
        retention: Retention | None = None,
        deltas: LiveDeltas | None = None,
    ) -> None:
        self.registry = registry
        self.workers = workers
        self.plugins = plugins
        self.log = log_adapter
        self.store = store
        self.catalog = catalog
        self.limits = limits
        self.metrics = metrics
        self.nc = nc
        self.incarnation = incarnation
        self._boot_report = boot_report
        self.presence = presence
        self._request_drain = request_drain
        self.retention = retention or Retention(
            log_adapter=log_adapter,
            store=store,
            registry=registry,
            forget=registry.folds.forget,
        )
        self._idempotency_locks = KeyedLocks()
        # Every event-stream reader of a session shares one tail of its log.
        self.tails = SessionTails(log_adapter)
        self.deltas = deltas if deltas is not None else LiveDeltas()

    # --- sessions ------------------------------------------------------------------------------------

    async def create_session(
        self,
        goal: str,
        *,
        agent: tuple[str, str | None] | None,
        definition: dict[str, Any] | None,
        by: str,
        session_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        """Start a session and answer its id: ``session_id`` when given (a caller that finds its
        session again by a key, as ``LocalMesh.run`` does; one that exists is refused with
        an error; it must be new), else a fresh one. With ``idempotency_key``, a request sent
        again with the same key (a client's retry, also after a daemon restart) answers the
        session the first one started, starting nothing; the same key with another request is
        ``IdempotencyConflict``."""
        _check_size("the goal", goal, self.limits.max_goal_bytes)
        if self.presence is not None and self.presence.state != "active":
            raise DaemonDraining(
                f"daemon {self.presence.daemon_id} is draining; start the session on another daemon"
            )
        if agent is not None:
            shape = await self._published_shape(agent[0], agent[1], check={})
        else:
            if definition is None:
                definition = DEFAULT_AGENT
            _check_size("the agent definition", definition, self.limits.max_definition_bytes)
            parsed = parse_definition(definition)
            skills = await self.catalog.resolve_skills(skill_names(parsed))
            shape = compose_shape(
                parsed,
                host=self.plugins,
                skills=skills,
                source="catalog" if parsed.skills else "inline",
            )
        if idempotency_key is None:
            session_id = session_id or uuid.uuid4().hex
            await self._start(session_id, goal, shape)
            return session_id
        request = hashlib.sha256(
            msgspec.json.encode({"goal": goal, "agent": agent, "definition": definition})
        ).hexdigest()
        async with self._idempotency_locks.hold(idempotency_key):
            stored = await self.store.get(IDEMPOTENCY_DB, idempotency_key)
            if stored is None:
                session_id = uuid.uuid4().hex
                # The key is kept before the session is started: a crash in between leaves
                # an id that the retry starts, never a second session.
                record = IdempotencyRecord(session_id=session_id, request=request)
                await self.store.write_batch(
                    [(IDEMPOTENCY_DB, idempotency_key, msgspec.msgpack.encode(record))]
                )
            else:
                record = msgspec.msgpack.decode(stored, type=IdempotencyRecord)
                if record.request != request:
                    raise IdempotencyConflict(
                        f"Idempotency-Key {idempotency_key!r} was used for another request"
                        f" (session {record.session_id}); use a new key for a new session"
                    )
                session_id = record.session_id
                if await self.log.last_index(session_id) >= 0:
                    return session_id
            await self._start(session_id, goal, shape)
            return session_id

    async def _start(self, session_id: str, goal: str, shape: SessionShape) -> None:
        # Nothing written (an event over the limit, say) leaves no session behind.
        await self.registry.adopt(
            new_state(session_id),
            recovered=None,
            fresh_children=False,
            opening=[
                SessionStarted(goal=goal, root="root", shape=shape),
                AgentLifecycle("root", "born", config=shape.root, task=goal, task_index=0),
            ],
        )

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
            check_pins(self.plugins, moved)
        shape = compose_shape(
            parsed,
            host=self.plugins,
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

    async def list_sessions(self, *, status: str | None, query: str | None) -> list[SessionSummary]:
        """Every session that matches, the most recently updated first (ties by id)."""
        rows: dict[str, SessionSummary] = {}
        for record in await self.registry.completed_records():
            rows[record.session_id] = SessionSummary(
                session_id=record.session_id,
                status=record.status,
                goal=record.goal,
                last_index=record.last_index,
                updated_at=record.ended_at,
                side_effects=record.side_effects,
            )
        for sid, rec in self.registry.stranded.items():
            rows[sid] = SessionSummary(
                session_id=sid,
                status="recoverable",
                goal=rec.goal,
                last_index=rec.state.last_index if rec.state else -1,
                updated_at=rec.last_event_at,
                side_effects=rec.side_effects,
            )
        for sid, runtime in self.registry.live.items():
            rows[sid] = session_summary(runtime.state)
        if self.presence is not None:
            # The sessions the other daemons drive, read from the log.
            for peer in self.presence.known.values():
                for sid in peer.sessions if peer.id != self.registry.owner else ():
                    if sid not in rows:
                        with contextlib.suppress(ApomeshError):
                            rows[sid] = session_summary(await self.registry.folds.state(sid))
        out = [
            r
            for r in rows.values()
            if (status is None or r.status == status)
            and (not query or query.lower() in r.goal.lower() or query.lower() in r.session_id)
        ]
        out.sort(key=lambda r: (-r.updated_at, r.session_id))
        return out

    async def get_session(self, session_id: str) -> SessionView:
        rec = self.registry.stranded.get(session_id)
        if rec is not None:
            if rec.state is None:
                return SessionView(
                    session_id=session_id, status="recoverable", goal="", reason=rec.reason
                )
            return session_view(rec.state, status="recoverable", reason=rec.reason)
        runtime = self.registry.writer(session_id)
        if runtime is not None:
            view = session_view(runtime.state)
            if view.terminal:
                return view  # as the log reads it: an ended session has no owner
            return msgspec.structs.replace(
                view, owner=self.registry.owner, agents=self._placed(view.agents)
            )
        view = await self.registry.folds.view(session_id)
        if view.terminal:
            return view
        return msgspec.structs.replace(view, owner=await self.registry.lease_owner(session_id))

    async def agent_conversation(self, session_id: str, ref: str) -> AgentConversation:
        return await load_conversation(self.log, self.store, session_id, ref)

    def _placed(self, agents: list[AgentSummary]) -> list[AgentSummary]:
        """The agents of a session this daemon drives, each one that needs a worker while no
        live worker runs it marked ``waiting_for`` (the fold still names the worker it was last
        dispatched to, which may be lost)."""
        alive = set(self.workers.alive_ids())
        placed: list[AgentSummary] = []
        for agent in agents:
            if agent.phase in NEEDS_A_WORKER and agent.worker not in alive:
                lost = f"; {agent.worker} was lost" if agent.worker else ""
                agent = msgspec.structs.replace(agent, waiting_for=f"a capable worker{lost}")
            placed.append(agent)
        return placed

    async def _check_owned_here(self, session_id: str) -> None:
        """Refuse a write for a session another daemon owns: its lease names that daemon, or
        the session waits on that daemon's recoverable list."""
        if self.registry.writer(session_id) is not None or session_id in self.registry.stranded:
            return
        await self.registry.check_owned_here(session_id)
        if self.presence is None:
            return
        for record in self.presence.known.values():
            if record.id != self.registry.owner and session_id in record.stranded:
                raise OwnedElsewhere(session_id, record.id, record.url)

    async def read_events(self, session_id: str, after: int) -> list[Envelope]:
        envelopes: list[Envelope] = await self.log.read(session_id, after)
        if not envelopes and await self.log.last_index(session_id) < 0:
            raise NotFound(f"session {session_id}")
        return envelopes

    async def tail_events(self, session_id: str, after: int) -> AsyncIterator[Envelope]:
        async for env in self.tails.follow(session_id, after):
            yield env

    def live_deltas(self, session_id: str) -> AsyncIterator[TurnDelta]:
        return self.deltas.follow(session_id)

    async def verify_session(self, session_id: str) -> VerificationView:
        """Fold the session's log from its start and check it against the stored snapshots,
        journal and completed record (see ``apomesh.runtime.verify``)."""
        from apomesh.runtime.verify import verify_session

        return await verify_session(self.log, self.store, session_id)

    async def answer_hitl(self, session_id: str, pause_id: str, answer: str, *, by: str) -> None:
        """Answer an open pause through the session's writer: a second answer to the same pause
        (a double click, two operators, a retry) is refused (``CommandRefused``), never logged."""
        await self._check_owned_here(session_id)
        runtime = self.registry.writer(session_id)
        if runtime is not None:
            await runtime.answer_hitl(pause_id, answer, by=by)
            return
        state = await self.registry.state(session_id)
        if pause_id not in state.hitl_pending:
            if pause_id in state.hitl_answers:
                raise CommandRefused(f"pause {pause_id} is not open: it was already answered")
            raise NotFound(f"open pause {pause_id} in session {session_id}")
        raise ApomeshError(f"session {session_id} is not running here; resume it first")

    async def resume(self, session_id: str, *, migrate_pins: dict[str, str], by: str) -> None:
        """Resume a session from the recoverable list (``OperatorAction(resume)``), first moving
        its plugin pins and/or its agent to another published version (``migrate_pins``, key
        ``agent``), each move logged as ``OperatorAction(migrate_pin)``. A pin that cannot be
        satisfied is a typed error naming it; a migration is checked whole before anything is
        logged."""
        await self._check_owned_here(session_id)
        rec = self.registry.stranded.get(session_id)
        if rec is None:
            await self._not_stranded(session_id, migrate_pins)
        shape, plugins = await self._migration_target(rec.state, migrate_pins)
        if rec.state is None:
            if rec.error is not None:
                raise rec.error
            raise ApomeshError(f"session {session_id} cannot be resumed: {rec.reason}")
        state = rec.state
        if state.bootstrap is None:
            raise ApomeshError(
                f"session {session_id} has no durable SessionStarted; it cannot be resumed"
            )
        migration: dict[str, Any] | None = None
        if shape is not None:
            migration = plan_agent_migration(self.plugins, state, shape, plugins or None)
        elif plugins:
            migration = {
                "pins": dict(plugins),
                "from": plan_migration(self.plugins, state, plugins),
            }
        else:
            check_shape(self.plugins, state)
        actions: list[Event] = []
        if migration is not None:
            actions.append(OperatorAction(action="migrate_pin", by=by, detail=migration))
        acknowledged = decisions.acknowledgement(state)
        detail = {
            "unknown_outcomes": len(acknowledged),
            "acknowledged": acknowledged,
            "reason": rec.reason,
        }
        actions.append(OperatorAction(action="resume", by=by, detail=detail))
        await self.registry.adopt(
            state, recovered="operator", fresh_children=False, opening=actions
        )

    async def resume_matching(self, which: RecoverableFilter, *, by: str) -> list[ResumeOutcome]:
        """Resume every recoverable session ``which`` matches, each exactly as ``resume`` does
        (its unknown outcomes acknowledged), up to ``BULK_RESUME_CONCURRENCY`` at once (each is
        its own session's writer; a restart with many sessions waiting does not resume them one
        round trip after another); a session that cannot be resumed is answered ``refused`` with
        its error and the others go on. Outcomes come in the order of the list."""
        chosen = [
            session_id
            for session_id, rec in list(self.registry.stranded.items())
            if which.matches(self._recoverable_view(rec))
        ]
        room = asyncio.Semaphore(BULK_RESUME_CONCURRENCY)

        async def resume_one(session_id: str) -> ResumeOutcome:
            async with room:
                try:
                    await self.resume(session_id, migrate_pins={}, by=by)
                except ApomeshError as exc:
                    return ResumeOutcome(
                        session_id=session_id,
                        outcome="refused",
                        error=exc.code,
                        message=exc.message,
                    )
            return ResumeOutcome(session_id=session_id, outcome="resumed")

        return list(await asyncio.gather(*(resume_one(s) for s in chosen)))

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
        rec = self.registry.stranded.get(session_id)
        if rec is None:
            await self._not_stranded(session_id, migrate_pins)
        view = self._recoverable_view(rec)
        # The preview shows the difference even when the move would be refused, and says why.
        shape, plugins = await self._migration_target(rec.state, migrate_pins or {}, check=False)
        if shape is None:
            return view
        assert rec.state is not None  # an undecodable session has no agent to move
        diff = agent_diff(self.plugins, rec.state, shape, plugins)
        return msgspec.structs.replace(view, agent_diff=diff)

    def _recoverable_view(self, rec: Recoverable) -> RecoverableView:
        diff: list[PinDiff] = []
        outcomes = []
        if rec.state is not None:
            outcomes = unknown_outcomes(rec.state)
            if rec.state.bootstrap is not None:
                installed = self.plugins.installed_versions()
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
        """Cancel a live or stranded session through its writer (opened, lease and all, for a
        session this daemon does not drive); refused once it has ended."""
        await self._check_owned_here(session_id)
        stranded = self.registry.stranded.get(session_id)
        runtime = await self.registry.open_writer(session_id)
        try:
            await runtime.cancel(by=by)
        except BaseException:
            if runtime.task is None and not runtime.state.terminal:
                # Opened for the cancel alone: give it back as it was.
                reason, category = (stranded.reason, stranded.category) if stranded else ("", "")
                await self.registry.end(runtime, Ending("stranded", reason, category))
            raise

    async def list_hitl(self) -> list[PendingPauseView]:
        """Every open pause of the sessions this daemon drives, then of its peers' (read from
        the log), by session then pause."""
        states: dict[str, SessionState] = {
            sid: runtime.state for sid, runtime in self.registry.live.items()
        }
        if self.presence is not None:
            for peer in self.presence.known.values():
                for sid in peer.sessions if peer.id != self.registry.owner else ():
                    if sid not in states:
                        with contextlib.suppress(ApomeshError):
                            states[sid] = await self.registry.folds.state(sid)
        return sorted(
            (
                PendingPauseView(
                    session_id=sid,
                    pause_id=pause.pause_id,
                    agent=pause.agent,
                    question=pause.question,
                    goal=state.goal,
                )
                for sid, state in states.items()
                for pause in state.hitl_pending.values()
            ),
            key=lambda p: (p.session_id, p.pause_id),
        )

    async def purge(self, session_id: str) -> None:
        """Remove an ended session: its log subject and every record of it
        (``runtime.retention``); a session that has not ended is refused."""
        await self.retention.purge(session_id)

    async def purge_ended(self, ended_before: float) -> list[str]:
        """Purge every session that ended before ``ended_before`` (unix seconds)."""
        return await self.retention.sweep(ended_before)

    async def list_recoverable(self) -> list[RecoverableView]:
        return [self._recoverable_view(r) for r in self.registry.stranded.values()]

    async def list_workers(self) -> list[WorkerView]:
        now = time.monotonic()
        pool = self.workers
        alive = [
            WorkerView(
                id=w.worker_id,
                name=w.name,
                last_heartbeat=w.last_beat_wall,
                agents=sorted(w.agents),
                tools=list(w.tools),
                providers=list(w.providers),
                alive=now - w.last_seen <= pool.threshold,
                plugins=dict(w.plugins),
                max_agents=w.max_agents,
            )
            for w in pool.workers.values()
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
                plugins=dict(w.plugins),
            )
            for w in reversed(pool.lost_workers.values())
            if w.worker_id not in pool.workers
        ]
        return alive + lost

    # --- daemons ------------------------------------------------------------------------------------

    async def list_daemons(self) -> list[DaemonView]:
        """Every live daemon on this NATS, from the presence records (this one first)."""
        if self.presence is None:
            return []
        now = time.time()
        me = self.presence.daemon_id
        views = [
            DaemonView(
                id=r.id,
                host=r.host,
                url=r.url,
                incarnation=r.incarnation,
                state=r.state,
                sessions=len(r.sessions) if r.state != "drained" else 0,
                stranded=len(r.stranded),
                load=r.load,
                started_at=r.started_at,
                last_seen=r.last_seen,
                lease_age=round(max(0.0, now - r.last_seen), 3),
                this=r.id == me,
            )
            for r in (await self.presence.peers()).values()
        ]
        views.sort(key=lambda v: (not v.this, v.id))
        return views

    async def drain_daemon(self, daemon_id: str) -> None:
        """Ask a live daemon (this one or a peer) to drain: its sessions stop at node boundaries
        and move to the live peers. ``NotFound`` for a daemon that is not alive."""
        if self.presence is None or self._request_drain is None:
            raise NotFound(f"daemon {daemon_id}")
        if daemon_id not in await self.presence.peers():
            raise NotFound(f"daemon {daemon_id}")
        await self._request_drain(daemon_id)

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
        m = self.metrics
        counts: dict[tuple[str, ...], float] = {}
        phases: dict[tuple[str, ...], float] = {}
        for runtime in self.registry.live.values():
            key = (runtime.state.status,)
            counts[key] = counts.get(key, 0) + 1
            for agent in runtime.state.agents.values():
                phases[(agent.phase,)] = phases.get((agent.phase,), 0) + 1
        counts[("recoverable",)] = len(self.registry.stranded)
        m.sessions.replace(counts)
        m.agents.replace(phases)
        m.recoverable_sessions.set(len(self.registry.stranded))
        m.workers_alive.set(len(self.workers.workers))
        return m.render()

    def _nats_server(self) -> str | None:
        """The host:port of the server the daemon's connection is on (of its ``urls``)."""
        url = getattr(self.nc, "connected_url", None)
        if url is None or not url.hostname:
            return None
        return f"{url.hostname}:{url.port}" if url.port else str(url.hostname)

    async def health(self) -> dict[str, Any]:
        """``status``: ``ok``; ``degraded`` when the daemon serves but cannot make progress on
        its own (no live worker, agents waiting for a capable worker), each reason in
        ``problems``; ``down`` when NATS is not connected (``ok`` false, HTTP 503)."""
        connected = self.nc.is_connected
        live_workers = set(self.workers.alive_ids())
        alive = len(live_workers)
        waiting = sum(
            1
            for runtime in self.registry.live.values()
            if any(
                agent.phase in NEEDS_A_WORKER and agent.worker not in live_workers
                for agent in runtime.state.agents.values()
            )
        )
        problems: list[str] = []
        if not connected:
            problems.append("NATS is not connected")
        if alive == 0:
            problems.append("no live worker")
        if waiting:
            problems.append(f"{waiting} sessions wait for a capable worker")
        status = "down" if not connected else "degraded" if problems else "ok"
        return {
            "ok": connected,
            "status": status,
            "problems": problems,
            "waiting_for_worker": waiting,
            "incarnation": self.incarnation,
            "nats": "connected" if connected else "reconnecting",
            "nats_server": self._nats_server() if connected else None,
            "daemon": self.registry.owner,
            "sessions": len(self.registry.live),
            "recoverable": len(self.registry.stranded),
            "workers": alive,
            "boot": self._boot_report(),
        }
