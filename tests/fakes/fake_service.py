"""An in-memory ``DaemonService`` for the API, SDK and console tests, and a helper that serves an
app with uvicorn on a free loopback port inside the test's event loop.

``FakeService`` keeps real event logs (``MemoryLog``: encoded envelopes, dense indexes, a live
tail) and folds them with the real core, so views and SSE streams behave as the daemon's do. Tests
drive sessions with the helpers (``start``, ``spawn``, ``phase``, ``pause``, ``side_effect``,
``end``, ``make_recoverable``, ``add_worker``) and read back what the API asked for in ``calls``.
"""

from __future__ import annotations

import hashlib
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette

from apomesh.adapters.memory_log import MemoryLog
from apomesh.api.app import ApiServer
from apomesh.core.definition import AgentDefinition, parse_definition, role_config
from apomesh.core.envelope import Envelope, make
from apomesh.core.errors import (
    ApomeshError,
    CatalogError,
    CommandRefused,
    DefinitionError,
    NotFound,
    PayloadTooLarge,
    PluginPinMismatch,
    PublishConflict,
)
from apomesh.core.events import (
    AgentLifecycle,
    AgentResumed,
    AgentResuming,
    Event,
    HitlAnswered,
    HitlPaused,
    OperatorAction,
    SessionEnded,
    SessionRecovered,
    SessionShape,
    SessionStarted,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.journal import call_key
from apomesh.core.state import SessionState, fold
from apomesh.core.views import (
    AgentRecordView,
    DaemonView,
    PendingPauseView,
    PinDiff,
    RecoverableFilter,
    RecoverableView,
    ResumeOutcome,
    SessionSummary,
    SessionView,
    SkillView,
    VerificationProblem,
    VerificationView,
    WorkerView,
    session_summary,
    session_view,
    unknown_outcomes,
)
from apomesh.runtime.live_deltas import LiveDeltas
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.protocol import TurnDelta

SKILL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class Stranded:
    """Why a session is on the fake's recoverable list."""

    reason: str
    category: str
    pin_diff: list[PinDiff] = field(default_factory=list)


def _version_key(version: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in version.split("."))


class FakeService:
    """``DaemonService`` in memory. Not thread-safe: use it from the test's event loop."""

    def __init__(self, *, max_skill_bytes: int = 64 * 1024) -> None:
        self.log = MemoryLog()
        self.recoverable: dict[str, Stranded] = {}
        self.workers: dict[str, WorkerView] = {}
        now = time.time()
        self.daemons: dict[str, DaemonView] = {
            "d-this": DaemonView(
                id="d-this",
                host="localhost",
                url="http://127.0.0.1:8750",
                incarnation="i1",
                state="active",
                sessions=0,
                stranded=0,
                load=0,
                started_at=now,
                last_seen=now,
                lease_age=0.0,
                this=True,
            )
        }
        self.skills: dict[str, SkillView] = {}
        self.agents: dict[tuple[str, str], AgentRecordView] = {}
        self.metrics = DaemonMetrics()
        self.deltas = LiveDeltas()
        """Publish ``TurnDelta``s here to show them to the sessions' live event streams."""
        self.calls: list[tuple[Any, ...]] = []
        self.max_skill_bytes = max_skill_bytes
        self.broken: Exception | None = None  # raised by the next service call, once

    # --- test helpers -------------------------------------------------------------------------

    def _check_broken(self) -> None:
        if self.broken is not None:
            error, self.broken = self.broken, None
            raise error

    async def emit(self, session_id: str, *events: Event) -> int:
        """Append events to a session's log; returns the index of the last one."""
        first = await self.log.last_index(session_id) + 1
        envelopes = [
            make(session_id, first + i, time.time(), uuid.uuid4().hex, event)
            for i, event in enumerate(events)
        ]
        await self.log.append(session_id, envelopes)
        for event in events:
            self.metrics.events_appended.labels(type(event).__name__).inc()
        return first + len(events) - 1

    async def start(
        self,
        goal: str = "write a haiku",
        *,
        definition: dict[str, Any] | None = None,
        agent: str | None = None,
        session_id: str | None = None,
    ) -> str:
        """A session with a durable bootstrap and a root agent that is running."""
        parsed = parse_definition(definition or {"name": "writer", "version": "1.0.0"})
        session_id = session_id or f"s{uuid.uuid4().hex[:12]}"
        shape = SessionShape(
            coordination=parsed.coordination,
            coordination_params=dict(parsed.coordination_params),
            root=role_config(parsed, "root", []),
            roles={role: role_config(parsed, role, []) for role in parsed.roles},
            skills=[],
            plugins=[],
            source="published" if agent else "inline",
            agent=agent,
        )
        await self.emit(
            session_id,
            SessionStarted(goal=goal, root="root", shape=shape),
            AgentLifecycle(agent="root", phase="born", config=shape.root),
            AgentLifecycle(agent="root", phase="running", worker="w1", epoch=1),
        )
        return session_id

    async def spawn(self, session_id: str, ref: str, parent: str, task: str) -> int:
        state = await self._state(session_id)
        config = state.agents[parent].config
        return await self.emit(
            session_id,
            AgentLifecycle(agent=ref, phase="born", parent=parent, task=task, config=config),
        )

    async def phase(self, session_id: str, ref: str, phase: Any, **fields: Any) -> int:
        return await self.emit(session_id, AgentLifecycle(agent=ref, phase=phase, **fields))

    async def pause(self, session_id: str, agent: str, question: str) -> str:
        pause_id = hashlib.sha256(f"{agent}:{question}".encode()).hexdigest()[:16]
        await self.emit(session_id, HitlPaused(agent=agent, pause_id=pause_id, question=question))
        return pause_id

    async def side_effect(
        self, session_id: str, agent: str, tool: str, args: dict[str, Any], *, recorded: bool = True
    ) -> str:
        key = call_key(tool, args)
        await self.emit(session_id, ToolCallIntent(agent=agent, key=key, tool=tool, args=args))
        if recorded:
            await self.emit(
                session_id,
                ToolCallRecorded(agent=agent, key=key, tool=tool, outcome="ok", result="ok"),
            )
        return key

    async def resume_agent(self, session_id: str, agent: str, epoch: int) -> int:
        await self.emit(session_id, AgentResuming(agent=agent, reason="worker lost", epoch=epoch))
        return await self.emit(session_id, AgentResumed(agent=agent, epoch=epoch))

    async def end(
        self, session_id: str, status: Any = "completed", output: str | None = "done"
    ) -> int:
        self.recoverable.pop(session_id, None)
        return await self.emit(session_id, SessionEnded(status=status, output=output))

    def make_recoverable(
        self,
        session_id: str,
        reason: str = "side effects logged (1)",
        category: str = "side_effects",
        pin_diff: list[PinDiff] | None = None,
    ) -> None:
        self.recoverable[session_id] = Stranded(reason, category, list(pin_diff or []))

    def add_worker(
        self,
        worker_id: str,
        name: str,
        agents: list[str],
        *,
        alive: bool = True,
        last_heartbeat: float | None = None,
    ) -> None:
        self.workers[worker_id] = WorkerView(
            id=worker_id,
            name=name,
            last_heartbeat=time.time() if last_heartbeat is None else last_heartbeat,
            agents=agents,
            tools=["fs.read", "fs.append"],
            providers=["scripted"],
            alive=alive,
        )

    async def _state(self, session_id: str) -> SessionState:
        envelopes = await self.log.read(session_id)
        if not envelopes:
            raise NotFound(f"session {session_id}")
        return fold(envelopes, session_id)

    def _status(self, state: SessionState) -> tuple[str, str | None]:
        stranded = self.recoverable.get(state.session_id)
        if stranded is not None and not state.terminal:
            return "recoverable", stranded.reason
        return state.status, None

    # --- DaemonService ------------------------------------------------------------------------

    async def create_session(
        self,
        goal: str,
        *,
        agent: tuple[str, str | None] | None,
        definition: dict[str, Any] | None,
        by: str,
        idempotency_key: str | None = None,
    ) -> str:
        self._check_broken()
        self.calls.append(("create_session", goal, agent, definition, by))
        label: str | None = None
        if agent is not None:
            record = await self.get_agent(*agent)
            definition = record.definition
            label = f"{record.name}@{record.version}"
        if definition is None:
            definition = {"name": "default", "version": "0"}
        parse_definition(definition)
        return await self.start(goal, definition=definition, agent=label)

    async def list_sessions(self, *, status: str | None, query: str | None) -> list[SessionSummary]:
        self._check_broken()
        rows: list[SessionSummary] = []
        for session_id in await self.log.list_sessions():
            state = await self._state(session_id)
            row = session_summary(state, self._status(state)[0])
            if status is not None and row.status != status:
                continue
            if query and query.lower() not in f"{row.goal} {row.session_id}".lower():
                continue
            rows.append(row)
        rows.sort(key=lambda r: (-r.updated_at, r.session_id))
        return rows

    async def list_hitl(self) -> list[PendingPauseView]:
        return []

    async def purge(self, session_id: str) -> None:
        raise NotFound(f"session {session_id}")

    async def purge_ended(self, ended_before: float) -> list[str]:
        return []

    async def get_session(self, session_id: str) -> SessionView:
        self._check_broken()
        state = await self._state(session_id)
        status, reason = self._status(state)
        return session_view(state, status, reason)

    async def read_events(self, session_id: str, after: int) -> list[Envelope]:
        self._check_broken()
        await self._state(session_id)
        return await self.log.read(session_id, after)

    async def tail_events(self, session_id: str, after: int) -> AsyncIterator[Envelope]:
        state = await self._state(session_id)
        if state.terminal and state.last_index <= after:
            return
        tail = self.log.tail(session_id, after)
        try:
            async for env in tail:
                yield env
                if isinstance(env.event, SessionEnded):
                    return
        finally:
            await tail.aclose()  # type: ignore[attr-defined]

    def live_deltas(self, session_id: str) -> AsyncIterator[TurnDelta]:
        return self.deltas.follow(session_id)

    async def verify_session(self, session_id: str) -> VerificationView:
        """The fake stores no snapshots: it folds the log and checks its event ids."""
        self._check_broken()
        state = await self._state(session_id)
        envelopes = await self.log.read(session_id)
        ids = [env.event_id for env in envelopes]
        problems = [
            VerificationProblem(kind="duplicate_event_id", message=f"event id {i} repeated")
            for i in sorted({i for i in ids if ids.count(i) > 1})
        ]
        return VerificationView(
            session_id=session_id,
            ok=not problems,
            status=state.status,
            events=len(envelopes),
            last_index=state.last_index,
            agents=len(state.agents),
            problems=problems,
        )

    async def answer_hitl(self, session_id: str, pause_id: str, answer: str, *, by: str) -> None:
        self._check_broken()
        state = await self._state(session_id)
        if pause_id in state.hitl_answers:
            raise CommandRefused(f"pause {pause_id} is not open: it was already answered")
        if pause_id not in state.hitl_pending:
            raise NotFound(f"open pause {pause_id} in session {session_id}")
        self.calls.append(("answer_hitl", session_id, pause_id, answer, by))
        await self.emit(session_id, HitlAnswered(pause_id=pause_id, answer=answer, by=by))

    async def resume(self, session_id: str, *, migrate_pins: dict[str, str], by: str) -> None:
        self._check_broken()
        await self._state(session_id)
        stranded = self.recoverable.get(session_id)
        if stranded is None:
            raise ApomeshError(f"session {session_id} is not on the recoverable list")
        for diff in stranded.pin_diff:
            if diff.new is None or migrate_pins.get(diff.name) != diff.new:
                raise PluginPinMismatch(
                    f"pinned at {diff.old}, installed {diff.new or 'nothing'}", pin=diff.name
                )
        self.calls.append(("resume", session_id, dict(migrate_pins), by))
        del self.recoverable[session_id]
        self.metrics.resumes.labels("operator").inc()
        await self.emit(
            session_id,
            OperatorAction(action="resume", by=by, detail={"migrate_pins": dict(migrate_pins)}),
            SessionRecovered(path="operator"),
        )

    async def resume_matching(self, which: RecoverableFilter, *, by: str) -> list[ResumeOutcome]:
        outcomes: list[ResumeOutcome] = []
        for view in await self.list_recoverable():
            if not which.matches(view):
                continue
            try:
                await self.resume(view.session_id, migrate_pins={}, by=by)
            except ApomeshError as exc:
                outcomes.append(
                    ResumeOutcome(
                        session_id=view.session_id,
                        outcome="refused",
                        error=exc.code,
                        message=exc.message,
                    )
                )
                continue
            outcomes.append(ResumeOutcome(session_id=view.session_id, outcome="resumed"))
        return outcomes

    async def recovery_preview(
        self, session_id: str, migrate_pins: dict[str, str] | None = None
    ) -> RecoverableView:
        self._check_broken()
        state = await self._state(session_id)
        stranded = self.recoverable.get(session_id)
        if stranded is None:
            raise ApomeshError(f"session {session_id} is not on the recoverable list")
        return self._recoverable_view(state, stranded)

    def _recoverable_view(self, state: SessionState, stranded: Stranded) -> RecoverableView:
        return RecoverableView(
            session_id=state.session_id,
            goal=state.goal,
            reason=stranded.reason,
            category=stranded.category,
            side_effects=state.side_effects,
            last_event_at=state.last_ts,
            unknown_outcomes=unknown_outcomes(state),
            pin_diff=list(stranded.pin_diff),
        )

    async def cancel(self, session_id: str, *, by: str) -> None:
        self._check_broken()
        state = await self._state(session_id)
        if state.terminal:
            raise ApomeshError(f"session {session_id} already ended ({state.status})")
        self.calls.append(("cancel", session_id, by))
        self.recoverable.pop(session_id, None)
        await self.emit(
            session_id,
            OperatorAction(action="cancel", by=by),
            SessionEnded(status="cancelled", reason=f"cancelled by {by}"),
        )

    async def list_recoverable(self) -> list[RecoverableView]:
        self._check_broken()
        views = []
        for session_id, stranded in sorted(self.recoverable.items()):
            views.append(self._recoverable_view(await self._state(session_id), stranded))
        return views

    async def list_workers(self) -> list[WorkerView]:
        self._check_broken()
        return sorted(self.workers.values(), key=lambda w: w.id)

    async def list_daemons(self) -> list[DaemonView]:
        self._check_broken()
        return list(self.daemons.values())

    async def drain_daemon(self, daemon_id: str) -> None:
        self._check_broken()
        if daemon_id not in self.daemons:
            raise NotFound(f"daemon {daemon_id}")
        self.daemons[daemon_id] = msgspec.structs.replace(self.daemons[daemon_id], state="drained")

    async def put_skill(self, name: str, body: str) -> SkillView:
        self._check_broken()
        if not SKILL_NAME.match(name):
            raise CatalogError(f"invalid skill name {name[:40]!r}")
        size = len(body.encode("utf-8", "surrogatepass"))
        if size > self.max_skill_bytes:
            raise PayloadTooLarge(f"skill {name}", size, self.max_skill_bytes)
        previous = self.skills.get(name)
        digest = hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()
        view = SkillView(
            name=name, body=body, digest=digest, revision=(previous.revision if previous else 0) + 1
        )
        self.skills[name] = view
        return view

    async def get_skill(self, name: str) -> SkillView:
        self._check_broken()
        try:
            return self.skills[name]
        except KeyError:
            raise NotFound(f"skill {name}") from None

    async def list_skills(self) -> list[SkillView]:
        self._check_broken()
        return [self.skills[name] for name in sorted(self.skills)]

    async def skill_history(self, name: str) -> list[SkillView]:
        return [await self.get_skill(name)]

    async def delete_skill(self, name: str) -> None:
        self._check_broken()
        if self.skills.pop(name, None) is None:
            raise NotFound(f"skill {name}")

    async def publish_agent(self, definition: dict[str, Any]) -> tuple[bool, AgentRecordView]:
        self._check_broken()
        parsed: AgentDefinition = parse_definition(definition)
        if not parsed.version.strip():
            raise DefinitionError("`version` is required to publish", where="agent definition")
        for skill in parsed.skills:
            if skill not in self.skills:
                raise NotFound(f"skill {skill}")
        digest = hashlib.sha256(msgspec.json.encode(definition, order="sorted")).hexdigest()
        key = (parsed.name, parsed.version)
        existing = self.agents.get(key)
        if existing is not None:
            if existing.digest != digest:
                raise PublishConflict(f"{parsed.name}@{parsed.version} exists with other content")
            return False, existing
        record = AgentRecordView(
            name=parsed.name,
            version=parsed.version,
            digest=digest,
            definition=definition,
            skills=list(parsed.skills),
        )
        self.agents[key] = record
        return True, record

    async def list_agents(self) -> list[AgentRecordView]:
        self._check_broken()
        return sorted(self.agents.values(), key=lambda a: (a.name, _version_key(a.version)))

    async def get_agent(self, name: str, version: str | None) -> AgentRecordView:
        self._check_broken()
        if version is not None:
            record = self.agents.get((name, version))
            if record is None:
                raise NotFound(f"agent {name}@{version}")
            return record
        versions = [a for (n, _), a in self.agents.items() if n == name]
        if not versions:
            raise NotFound(f"agent {name}")
        return max(versions, key=lambda a: _version_key(a.version))

    async def metrics_text(self) -> str:
        self._check_broken()
        counts: dict[tuple[str, ...], float] = {}
        for session_id in await self.log.list_sessions():
            status = self._status(await self._state(session_id))[0]
            counts[(status,)] = counts.get((status,), 0) + 1
        self.metrics.sessions.replace(counts)
        self.metrics.recoverable_sessions.set(len(self.recoverable))
        return self.metrics.render()

    async def health(self) -> dict[str, Any]:
        self._check_broken()
        return {"ok": True, "sessions": len(await self.log.list_sessions())}


# --- serving an app in the test's event loop -------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@asynccontextmanager
async def serving(app: Starlette, port: int | None = None) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port unless given); yields its base URL.

    The server stops (open streams cut) when the block exits."""
    port = port or free_port()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = ApiServer(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve, [sock])
        with anyio.fail_after(10):
            while not server.started:
                await anyio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
    sock.close()
