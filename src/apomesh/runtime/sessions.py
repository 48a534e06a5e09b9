"""One live session on the daemon: its folded state, its appends, its coordinator loop and the
driving of its agents onto workers.

The daemon is the single writer of a session: ``append`` numbers events, appends them to the log
and only then folds them into the in-memory state, one step at a time under a lock. The coordinator
loop (a coordination kind) runs against ``SessionRuntime`` as its ``CoordinatorContext``. Each agent
run is driven by ``drive_agent``: dispatch to a worker with a new fencing epoch, wait for the
outcome, and when the worker is lost append ``AgentResuming`` and re-dispatch under the same ref.
Agents are composed from the session's effective shape: after an operator moved the session to
another agent version, new children are born with the new role configs and an agent dispatched
again is moved to its role's new config on its ``dispatched`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from apomesh.core import envelope
from apomesh.core.definition import AgentConfig
from apomesh.core.errors import Fenced, LogUnavailable
from apomesh.core.events import (
    AgentLifecycle,
    AgentResumed,
    AgentResuming,
    CoordinatorCheckpoint,
    Event,
    SessionEnded,
    SessionRecovered,
    SessionShape,
    event_name,
)
from apomesh.core.state import AgentView, SessionState, apply
from apomesh.plugins.api import ChildResult, RootAnswer
from apomesh.runtime.protocol import Done, Run

if TYPE_CHECKING:
    from apomesh.runtime.daemon import Daemon

log = logging.getLogger("apomesh.session")


class WorkerLost(Exception):
    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(reason)
        self.worker_id = worker_id
        self.reason = reason


class AgentFailed(Exception):
    """An agent the coordinator needed ended without an answer."""


class Held(Exception):
    """The session waits for an operator (an unknown side-effect outcome under a ``hold`` policy)."""


@dataclass
class DispatchSlot:
    """The one in-flight dispatch of an agent: the only epoch and worker it accepts reports from."""

    agent: str
    epoch: int
    worker_id: str
    future: asyncio.Future[Done]
    intents: set[str] = field(default_factory=set)
    running_logged: bool = False
    nodes: set[tuple[int, str, bool]] = field(default_factory=set)
    """(step, source, reset) of every node report stored for this dispatch (retries are no-ops)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises this dispatch's reports, so a retry never races its first copy."""


class SessionRuntime:
    """A session the daemon drives. Implements ``CoordinatorContext`` for the coordination kind."""

    def __init__(
        self, daemon: Daemon, state: SessionState, *, fresh_children: bool = False
    ) -> None:
        self.daemon = daemon
        self.state = state
        self.session_id = state.session_id
        self.fresh_children = fresh_children
        self.slots: dict[str, DispatchSlot] = {}
        self.changed = asyncio.Condition()
        self._append_lock = asyncio.Lock()
        self.task: asyncio.Task[None] | None = None
        self.held_reason: str | None = None
        self._reserved: set[str] = set()
        self._recovering = fresh_children or bool(state.agents)

    # --- appends ---------------------------------------------------------------------------------

    async def append(self, *events: Event) -> int:
        """Append a step's events (numbered from the next index) and fold them in; answers the
        index of the last one."""
        async with self._append_lock:
            if self.state.terminal:
                # A report or request that raced the session's end: refused, never appended.
                raise Fenced(f"session {self.session_id} has ended; nothing more is appended")
            now = time.time()
            first = self.state.last_index + 1
            envs = [
                envelope.make(self.session_id, first + i, now, uuid.uuid4().hex, ev)
                for i, ev in enumerate(events)
            ]
            started = time.perf_counter()
            await self._append_durably(envs)
            self.daemon.metrics_appended(
                len(envs), time.perf_counter() - started, [event_name(e) for e in events]
            )
            for env in envs:
                apply(self.state, env)
        async with self.changed:
            self.changed.notify_all()
        return self.state.last_index

    async def _append_durably(self, envs: list[envelope.Envelope]) -> None:
        # While NATS is out of reach (a server restart) the step waits and is sent again, the
        # same envelopes with the same ids: the log settles a resend, so nothing is written twice.
        delay = 0.05
        warned = False
        while True:
            try:
                await self.daemon.log.append(self.session_id, envs)
                return
            except LogUnavailable as exc:
                if self.daemon.closing:
                    raise
                if not warned:
                    log.warning("session %s waits for the log: %s", self.session_id, exc)
                    warned = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def wait_for(self, predicate: Any, timeout: float | None = None) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(predicate), timeout)

    async def poke(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    # --- CoordinatorContext ------------------------------------------------------------------------

    @property
    def goal(self) -> str:
        return self.state.goal

    @property
    def shape(self) -> SessionShape:
        """The shape agents are composed from now (a migrated agent version's, if any)."""
        shape = self.state.effective_shape
        assert shape is not None
        return shape

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.shape.coordination_params)

    @property
    def checkpoint(self) -> bytes | None:
        return self.state.checkpoint.state if self.state.checkpoint else None

    async def save_checkpoint(self, position: str, state: bytes) -> None:
        await self.append(CoordinatorCheckpoint(position=position, state=state))

    async def ask_root(self, purpose: str, prompt: str) -> RootAnswer:
        root = self.state.agents[self.state.root or "root"]
        if self._recovering and root.purpose == purpose and root.phase in ("planned", "completed"):
            # The root answered this before the crash but the loop had not checkpointed it yet.
            self._recovering = False
            return _answer(root)
        self._recovering = False
        await self.drive_agent(root.ref, purpose=purpose, prompt=prompt)
        root = self.state.agents[root.ref]
        if root.phase not in ("planned", "completed"):
            raise AgentFailed(f"the root agent ended {root.phase}: {root.reason or ''}".strip())
        return _answer(root)

    async def run_children(
        self, batch: str, tasks: list[str], *, role: str = "worker", max_parallel: int = 4
    ) -> list[ChildResult]:
        self._recovering = False
        root = self.state.root or "root"
        config = self.shape.roles.get(role)
        if config is None:
            raise AgentFailed(f"the session has no role {role!r}")
        latest: dict[int, AgentView] = {}
        for ref in self.state.children_of(root):
            child = self.state.agents[ref]
            if child.batch == batch and child.task_index is not None:
                latest[child.task_index] = child
        gate = asyncio.Semaphore(max_parallel)

        async def one(index: int, task: str) -> ChildResult:
            async with gate:
                child = latest.get(index)
                if child is not None and child.phase == "completed":
                    return ChildResult(child.ref, task, index, True, child.output or "")
                if child is not None and not child.terminal and self.fresh_children:
                    await self.append(
                        AgentLifecycle(
                            child.ref,
                            "cancelled",
                            reason="superseded by a fresh agent after a daemon restart",
                        )
                    )
                    child = None
                if child is None or child.terminal:
                    ref = self._reserve_child_ref(root)
                    await self.append(
                        AgentLifecycle(
                            ref,
                            "born",
                            parent=root,
                            config=config,
                            task=task,
                            task_index=index,
                            batch=batch,
                        )
                    )
                    child = self.state.agents[ref]
                await self.drive_agent(child.ref, purpose="act", prompt=task)
                child = self.state.agents[child.ref]
                ok = child.phase == "completed"
                return ChildResult(
                    child.ref, task, index, ok, child.output or "", child.reason or ""
                )

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

    def _reserve_child_ref(self, parent: str) -> str:
        # Concurrent spawns must not pick the same ref before either birth is on the log.
        n = len(self.state.children_of(parent))
        while f"{parent}/{n}" in self.state.agents or f"{parent}/{n}" in self._reserved:
            n += 1
        ref = f"{parent}/{n}"
        self._reserved.add(ref)
        return ref

    # --- driving one agent -------------------------------------------------------------------------

    async def drive_agent(self, ref: str, *, purpose: str, prompt: str) -> None:
        """Run one agent until it answers (or fails), re-dispatching it when its worker is lost."""
        agent = self.state.agents[ref]
        resume_reason: str | None = None
        lost_worker: str | None = None
        if agent.phase in ("dispatched", "running", "waiting", "paused") and agent.epoch > 0:
            resume_reason = "daemon restart" if self.fresh_children else "operator resume"
            lost_worker = agent.worker
        resuming = False
        while True:
            await self.wait_for(lambda: self._ready_to_dispatch(ref))
            if self.held_reason:
                raise Held(self.held_reason)
            moved_to = self._migrated_config(agent)
            config = moved_to or agent.current_config
            assert config is not None
            worker_id = await self.daemon.pick_worker(config, prefer=agent.worker)
            try:
                epoch = agent.epoch + 1
                agent_key = f"{self.session_id}/{ref}"
                memory = await self.daemon.snapshots.load(agent_key)
                if resume_reason is not None:
                    await self.append(
                        AgentResuming(
                            ref,
                            reason=resume_reason,
                            worker=lost_worker,
                            snapshot_id=agent.snapshot_id,
                            epoch=epoch,
                        )
                    )
                    if _path_label(resume_reason) == "worker_lost":
                        # Agents re-dispatched by a session's own recovery are counted with it.
                        self.daemon.metrics.resumes.labels("worker_lost").inc()
                    resuming = True
                    resume_reason = None
                await self.append(
                    AgentLifecycle(
                        ref,
                        "dispatched",
                        worker=worker_id,
                        epoch=epoch,
                        purpose=purpose,
                        config=moved_to,
                    )
                )
                loop = asyncio.get_running_loop()
                slot = DispatchSlot(ref, epoch, worker_id, loop.create_future())
                self.slots[ref] = slot
                run = Run(
                    session_id=self.session_id,
                    agent=ref,
                    epoch=epoch,
                    config=config,
                    purpose=purpose,
                    prompt=prompt,
                    task=agent.task or "",
                    task_index=agent.task_index or 0,
                    memory=memory,
                    incarnation=self.daemon.incarnation,
                )
                try:
                    if not await self.daemon.send_run(worker_id, run):
                        resume_reason, lost_worker = "dispatch not acknowledged", worker_id
                        await asyncio.sleep(0.2)
                        continue
                    done = await slot.future
                except WorkerLost as lost:
                    resume_reason, lost_worker = lost.reason, lost.worker_id
                    continue
                except asyncio.CancelledError:
                    with contextlib.suppress(Exception):
                        await self.daemon.send_cancel(
                            worker_id, self.session_id, ref, epoch, "session cancelled"
                        )
                    raise
                finally:
                    if self.slots.get(ref) is slot:
                        del self.slots[ref]
                    if slot.future.done() and not slot.future.cancelled():
                        slot.future.exception()  # a loss noticed while the dispatch was refused
            finally:
                self.daemon.release_worker(worker_id)
            if resuming:
                await self.append(AgentResumed(ref, epoch=epoch))
                resuming = False
            if await self._settle(ref, done, purpose):
                return

    def _migrated_config(self, agent: AgentView) -> AgentConfig | None:
        """The config of the agent's role in the migrated shape, when the agent does not run
        with it yet (None without a migration, or when nothing changes)."""
        shape = self.state.migrated_shape
        current = agent.current_config
        if shape is None or current is None:
            return None
        wanted = shape.root if current.role == "root" else shape.roles.get(current.role)
        return wanted if wanted is not None and wanted != current else None

    def _ready_to_dispatch(self, ref: str) -> bool:
        if self.held_reason:
            return True
        paused = any(p.agent == ref for p in self.state.hitl_pending.values())
        jobs = any(j.agent == ref for j in self.state.jobs_in_flight.values())
        return not paused and not jobs

    async def _settle(self, ref: str, done: Done, purpose: str) -> bool:
        """Record a dispatch's outcome; True when the agent answered or ended."""
        if done.outcome == "final":
            await self.append(AgentLifecycle(ref, "completed", output=done.output, purpose=purpose))
            return True
        if done.outcome == "plan":
            await self.append(AgentLifecycle(ref, "planned", plan=done.plan or [], purpose=purpose))
            return True
        if done.outcome == "paused":
            await self.append(AgentLifecycle(ref, "paused", reason=done.reason))
            return False
        if done.outcome == "waiting":
            await self.append(AgentLifecycle(ref, "waiting", reason=done.reason))
            if done.reason.startswith("held"):
                self.held_reason = done.reason
                raise Held(done.reason)
            return False
        await self.append(AgentLifecycle(ref, "failed", reason=done.reason or done.outcome))
        return True

    # --- the coordinator task ----------------------------------------------------------------------

    def start(self, recovered: Literal["auto", "operator"] | None = None) -> None:
        self.task = asyncio.create_task(self._run(recovered), name=f"session-{self.session_id}")

    async def _run(self, recovered: Literal["auto", "operator"] | None) -> None:
        shape = self.shape
        try:
            if recovered is not None:
                await self.append(
                    SessionRecovered(
                        path=recovered,
                        checkpoint_index=self.state.checkpoint_index,
                        incarnation=self.daemon.incarnation,
                    )
                )
                self.daemon.metrics.resumes.labels(recovered).inc()
            root = self.state.root
            if root is not None and root not in self.state.agents:
                # A crash between SessionStarted and the root's birth (one step, two appends).
                await self.append(
                    AgentLifecycle(
                        root, "born", config=shape.root, task=self.state.goal, task_index=0
                    )
                )
            for job in list(self.state.jobs_in_flight.values()):
                self.daemon.start_job(self, job)
            kind = self.daemon.plugins.coordination_kinds()[shape.coordination]
            output = await kind.run(self)
            await self.append(SessionEnded(status="completed", output=output))
        except asyncio.CancelledError:
            raise
        except Held as held:
            log.warning("session %s held for an operator: %s", self.session_id, held)
            self.daemon.mark_recoverable(self, f"held for an operator: {held}", "held")
            return
        except Exception as exc:
            if self.state.terminal:
                return
            log.warning("session %s failed: %s", self.session_id, exc)
            with contextlib.suppress(Exception):
                await self.append(
                    SessionEnded(
                        status="failed",
                        reason=f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc),
                    )
                )
        finally:
            if self.state.terminal:
                await self.daemon.session_finished(self)

    async def cancel(self, reason: str) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        for slot in list(self.slots.values()):
            with contextlib.suppress(Exception):
                await self.daemon.send_cancel(
                    slot.worker_id, self.session_id, slot.agent, slot.epoch, reason
                )
        if not self.state.terminal:
            await self.append(SessionEnded(status="cancelled", reason=reason))
            await self.daemon.session_finished(self)

    async def stop(self) -> None:
        """Stop driving (daemon shutdown): the log keeps everything; a later boot resumes."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task


def _answer(root: AgentView) -> RootAnswer:
    if root.phase == "planned":
        return RootAnswer(plan=list(root.plan or []))
    return RootAnswer(final=root.output or "")


def _path_label(reason: str) -> str:
    if reason.startswith("daemon restart"):
        return "auto"
    if reason.startswith("operator"):
        return "operator"
    return "worker_lost"
