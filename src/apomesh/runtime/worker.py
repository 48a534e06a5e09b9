"""``apomesh worker``: runs agents' tool-use loops for the daemon, holding no durable state.

A worker speaks core NATS only (request/reply and plain publishes, never the JetStream API), so it
runs unchanged behind a leaf node. It registers with its tools and model providers, beats on
``apomesh.hb.<worker_id>`` from its own task, takes dispatches on ``apomesh.dispatch.<worker_id>``
and runs each in a task. When it sees a new daemon incarnation it abandons every running dispatch
(the new daemon re-dispatches them under new epochs) and registers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from apomesh.core.errors import ApomeshError, Fenced
from apomesh.plugins.api import ModelProvider, SupervisorPolicy, Tool
from apomesh.runtime.agent_loop import run_agent
from apomesh.runtime.protocol import (
    DISPATCH_DECODER,
    ENCODER,
    MEMORY_DECODER,
    REGISTER_REPLY_DECODER,
    REPLY_DECODER,
    SUBJECT_DONE,
    SUBJECT_HITL,
    SUBJECT_JOB,
    SUBJECT_JOURNAL,
    SUBJECT_MEMORY,
    SUBJECT_NODE,
    SUBJECT_REGISTER,
    SUBJECT_TURN,
    AgentMemory,
    Beat,
    Cancel,
    DispatchAck,
    Done,
    HitlAsk,
    JobStart,
    JournalBegin,
    JournalFinish,
    MemoryFetch,
    NodeReport,
    Register,
    Reply,
    Report,
    Reregister,
    Run,
    TurnReport,
    beat_subject,
    bound_subject,
    check_worker_id,
    dispatch_subject,
)

log = logging.getLogger("apomesh.worker")

_SUBJECTS: dict[type, str] = {
    NodeReport: SUBJECT_NODE,
    TurnReport: SUBJECT_TURN,
    JournalBegin: SUBJECT_JOURNAL,
    JournalFinish: SUBJECT_JOURNAL,
    HitlAsk: SUBJECT_HITL,
    JobStart: SUBJECT_JOB,
    MemoryFetch: SUBJECT_MEMORY,
    Done: SUBJECT_DONE,
}


class Worker:
    """One worker: owns its NATS connection's subscriptions, heartbeat task and agent tasks."""

    def __init__(
        self,
        nc: NATS,
        *,
        tools: dict[str, Tool],
        providers: dict[str, ModelProvider],
        supervisors: list[SupervisorPolicy] | None = None,
        workspace: Path,
        name: str | None = None,
        worker_id: str | None = None,
        heartbeat_interval: float = 1.0,
        request_timeout: float = 5.0,
        plugin_versions: dict[str, str] | None = None,
    ) -> None:
        self.nc = nc
        self.plugin_versions = dict(plugin_versions or {})
        """Sent on ``Register``: the daemon places on this worker only agents whose session pins
        these versions."""
        self.tools = tools
        self.providers = providers
        self.supervisors = supervisors or []
        self.workspace = workspace
        self.name = name or socket.gethostname()
        self.worker_id = check_worker_id(worker_id or f"{_safe(self.name)}-{uuid.uuid4().hex[:8]}")
        self.instance = uuid.uuid4().hex[:12]
        self.heartbeat_interval = heartbeat_interval
        self.request_timeout = request_timeout
        self.incarnation = ""
        self.running: dict[tuple[str, str], tuple[int, asyncio.Task[None]]] = {}
        self._run_incarnation: dict[tuple[str, str], str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._beat_task: asyncio.Task[None] | None = None
        self._sub: Any = None
        self._registered = asyncio.Event()
        self._beat_now = asyncio.Event()
        self._register_lock = asyncio.Lock()
        self._closing = False
        self._seq = 0

    async def start(self) -> None:
        self.workspace.mkdir(parents=True, exist_ok=True)
        self._sub = await self.nc.subscribe(dispatch_subject(self.worker_id), cb=self._on_dispatch)
        self._beat_task = asyncio.create_task(self._beat_forever(), name=f"beat-{self.worker_id}")
        self._spawn(self.register())

    async def wait_registered(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self._registered.wait(), timeout)

    async def aclose(self) -> None:
        self._closing = True
        if self._beat_task:
            self._beat_task.cancel()
        for _, task in list(self.running.values()):
            task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(
            *(t for _, t in self.running.values()), *self._tasks, return_exceptions=True
        )
        if self._beat_task:
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat_task
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    # --- registration and heartbeat --------------------------------------------------------------

    async def register(self) -> None:
        """Register until a daemon answers; a new incarnation abandons every running dispatch."""
        async with self._register_lock:
            delay = 0.1
            while not self._closing:
                request = Register(
                    self.worker_id,
                    self.name,
                    sorted(self.tools),
                    sorted(self.providers),
                    incarnation_seen=self.incarnation,
                    pid=os.getpid(),
                    instance=self.instance,
                    plugins=self.plugin_versions,
                )
                try:
                    msg = await self.nc.request(
                        bound_subject(SUBJECT_REGISTER, self.worker_id),
                        ENCODER.encode(request),
                        timeout=self.request_timeout,
                    )
                    reply = REGISTER_REPLY_DECODER.decode(msg.data)
                except (TimeoutError, NatsTimeout, NoRespondersError):
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                if not reply.ok:
                    log.error("worker %s refused by the daemon: %s", self.worker_id, reply.reason)
                    await asyncio.sleep(5.0)
                    continue
                # Several daemons may answer: a dispatch of one is never abandoned for another
                # (a restarted daemon's stale epochs are fenced when they report).
                self.incarnation = reply.incarnation
                self.heartbeat_interval = reply.heartbeat_interval or self.heartbeat_interval
                self._registered.set()
                self._beat_now.set()
                log.info("worker %s registered with daemon %s", self.worker_id, reply.incarnation)
                return

    async def _beat_forever(self) -> None:
        while True:
            self._seq += 1
            beat = Beat(
                self.worker_id,
                self.name,
                self.incarnation,
                agents=[f"{s}/{a}" for (s, a) in self.running],
                seq=self._seq,
            )
            with contextlib.suppress(Exception):
                await self.nc.publish(beat_subject(self.worker_id), ENCODER.encode(beat))
            # A registration may set a shorter interval than the one being slept: beat at once
            # then, or the daemon's first silence window could close before the next beat.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.heartbeat_interval)
            self._beat_now.clear()

    def _abandon_all(self, reason: str, keep: str = "") -> None:
        """Cancel every dispatch except those the incarnation ``keep`` sent (a new daemon may
        dispatch to us before our registration with it has been answered)."""
        for key, (_, task) in list(self.running.items()):
            if keep and self._run_incarnation.get(key) == keep:
                continue
            log.warning("abandoning %s: %s", key, reason)
            task.cancel()
            del self.running[key]

    # --- dispatch --------------------------------------------------------------------------------

    async def _on_dispatch(self, msg: Msg) -> None:
        try:
            message = DISPATCH_DECODER.decode(msg.data)
        except Exception as exc:
            await _respond(msg, DispatchAck(False, f"undecodable dispatch: {exc}"))
            return
        if isinstance(message, Reregister):
            await _respond(msg, DispatchAck(True))
            # Also from the incarnation we know: it asks when it no longer lists us (it declared
            # us lost during a silence), and only a new registration puts us back on its list.
            self._spawn(self.register())
            return
        if isinstance(message, Cancel):
            key = (message.session_id, message.agent)
            current = self.running.get(key)
            if current and current[0] <= message.epoch:
                current[1].cancel()
                self.running.pop(key, None)
            await _respond(msg, DispatchAck(True))
            return
        assert isinstance(message, Run)
        if message.incarnation and self.incarnation and message.incarnation != self.incarnation:
            # A dispatch from a daemon we have not registered with yet: take it, then re-register.
            self._spawn(self.register())
        key = (message.session_id, message.agent)
        old = self.running.get(key)
        if old is not None:
            if old[0] >= message.epoch:
                await _respond(msg, DispatchAck(False, f"epoch {message.epoch} is stale"))
                return
            old[1].cancel()
        task = asyncio.create_task(
            self._run(message), name=f"agent-{message.session_id}-{message.agent}"
        )
        self.running[key] = (message.epoch, task)
        self._run_incarnation[key] = message.incarnation
        await _respond(msg, DispatchAck(True))

    async def _run(self, run: Run) -> None:
        key = (run.session_id, run.agent)
        try:
            if run.memory_pages:
                run = msgspec.structs.replace(run, memory=await self._fetch_memory(run))
            done = await run_agent(
                run,
                worker_id=self.worker_id,
                workspace=self.workspace,
                tools=self.tools,
                providers=self.providers,
                supervisors=self.supervisors,
                send=self.send,
            )
            await self.send(done)
        except Fenced as exc:
            log.warning("dispatch %s epoch %s fenced off: %s", key, run.epoch, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("agent %s failed", key)
            with contextlib.suppress(Exception):
                await self.send(
                    Done(
                        self.worker_id,
                        run.session_id,
                        run.agent,
                        run.epoch,
                        outcome="failed",
                        reason=f"{type(exc).__name__}: {exc}",
                    )
                )
        finally:
            current = self.running.get(key)
            if current is not None and current[0] == run.epoch:
                self.running.pop(key, None)
                self._run_incarnation.pop(key, None)

    async def _fetch_memory(self, run: Run) -> AgentMemory:
        """The dispatch's working memory, fetched page by page (it was too large to travel with
        the dispatch); a page the daemon refuses ends the dispatch like any refused report."""
        pages: list[bytes] = []
        for page in range(run.memory_pages):
            fetch = MemoryFetch(self.worker_id, run.session_id, run.agent, run.epoch, page)
            reply = await self.send(fetch)
            if reply.status == "fenced":
                raise Fenced(reply.message or "this dispatch was fenced off by a newer epoch")
            if reply.status != "ok":
                raise ApomeshError(f"memory page {page} refused: {reply.message}")
            pages.append(reply.data)
        return MEMORY_DECODER.decode(b"".join(pages))

    async def send(self, report: Report) -> Reply:
        """Send a report, retrying while the daemon is away; the daemon dedupes retries."""
        subject = bound_subject(_SUBJECTS[type(report)], self.worker_id)
        data = ENCODER.encode(report)
        delay = 0.1
        while True:
            try:
                msg = await self.nc.request(subject, data, timeout=self.request_timeout)
                return REPLY_DECODER.decode(msg.data)
            except (TimeoutError, NatsTimeout, NoRespondersError):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _respond(msg: Msg, ack: DispatchAck) -> None:
    if msg.reply:
        with contextlib.suppress(Exception):
            await msg.respond(ENCODER.encode(ack))


def _safe(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)
    return cleaned or "worker"
