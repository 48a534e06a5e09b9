"""``apomesh worker``: runs agents' tool-use loops for every daemon on its NATS, holding no
durable state.

A worker speaks core NATS only (request/reply and plain publishes, never the JetStream API), so it
runs unchanged behind a leaf node. It beats on ``apomesh.hb.<worker_id>`` from its own task, takes
dispatches on ``apomesh.dispatch.<worker_id>`` and runs each in a task, at most ``max_agents`` at
once (one more is refused, and said so). It registers with each daemon that asks it to (a daemon
asks when its incarnation is missing from the worker's beats) and reports a dispatch only to the
daemon that sent it (``runtime.protocol``). A new incarnation of a daemon abandons that daemon's
older dispatches and nobody else's (the new incarnation re-dispatches them under new epochs); a
dispatch whose daemon stops answering for ``daemon_gone_after`` seconds is abandoned too. Its
tools are its plugins' and those of the MCP servers it reaches (``builtin.mcp_tools``), connected
at ``start``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from apomesh.adapters.nats_connect import Replies
from apomesh.builtin.mcp_tools import McpServer, McpTools
from apomesh.core.errors import ApomeshError, Fenced
from apomesh.plugins.api import ModelProvider, SupervisorPolicy, Tool
from apomesh.runtime import tracing
from apomesh.runtime.agent_loop import run_agent
from apomesh.runtime.protocol import (
    DEFAULT_DAEMON_GONE_AFTER,
    DEFAULT_MAX_AGENTS,
    DISPATCH_DECODER,
    ENCODER,
    MEMORY_DECODER,
    REGISTER_REPLY_DECODER,
    REPLY_DECODER,
    VERB_DELTA,
    VERB_DONE,
    VERB_HITL,
    VERB_JOB,
    VERB_JOURNAL,
    VERB_MEMORY,
    VERB_MODEL,
    VERB_NODE,
    VERB_REGISTER,
    VERB_TURN,
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
    ModelCallFailed,
    NodeReport,
    Register,
    Reply,
    Report,
    Reregister,
    Run,
    TurnDelta,
    TurnReport,
    beat_subject,
    check_worker_id,
    control_subject,
    delta_pieces,
    dispatch_subject,
)

log = logging.getLogger("apomesh.worker")

HELD_UP_BEATS = 2.0
"""Heartbeat intervals without a beat after which a worker warns that its event loop was held up."""

_VERBS: dict[type, str] = {
    NodeReport: VERB_NODE,
    TurnReport: VERB_TURN,
    JournalBegin: VERB_JOURNAL,
    JournalFinish: VERB_JOURNAL,
    HitlAsk: VERB_HITL,
    JobStart: VERB_JOB,
    MemoryFetch: VERB_MEMORY,
    ModelCallFailed: VERB_MODEL,
    Done: VERB_DONE,
}


class DaemonGone(Fenced):
    """The daemon that sent a dispatch left its reports unanswered for too long: the dispatch is
    abandoned (whoever owns the session now dispatches it again under a new epoch)."""


class RunningAgent(msgspec.Struct):
    """One dispatch this worker runs: its epoch, its task and the daemon that sent it."""

    epoch: int
    task: asyncio.Task[None]
    daemon: str
    incarnation: str


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
        max_agents: int = DEFAULT_MAX_AGENTS,
        daemon_gone_after: float = DEFAULT_DAEMON_GONE_AFTER,
        mcp_servers: dict[str, McpServer] | None = None,
    ) -> None:
        self.nc = nc
        self._replies = Replies(nc)
        self.local_links: dict[str, Callable[[Report, bytes], Awaitable[Reply]]] = {}
        """Daemons in this very process (``ControlPlane.local_link``), by id: reports to them skip
        the NATS round trip; registration and heartbeats still go over NATS like any worker's."""
        self.plugin_versions = dict(plugin_versions or {})
        """Sent on ``Register``: the daemon places on this worker only agents whose session pins
        these versions."""
        self.tools = dict(tools)
        self.mcp = McpTools(mcp_servers or {})
        """The MCP servers this worker connects to at ``start``: it offers their tools too."""
        self.providers = providers
        self.supervisors = supervisors or []
        self.workspace = workspace
        self.name = name or socket.gethostname()
        self.worker_id = check_worker_id(worker_id or f"{_safe(self.name)}-{uuid.uuid4().hex[:8]}")
        self.instance = uuid.uuid4().hex[:12]
        self.heartbeat_interval = heartbeat_interval
        self._asked_intervals: dict[str, float] = {}
        """The heartbeat interval each daemon asked for: the worker beats at the shortest."""
        self.request_timeout = request_timeout
        if max_agents < 1:
            raise ValueError(f"max_agents must be at least 1, not {max_agents}")
        self.max_agents = max_agents
        self.daemon_gone_after = daemon_gone_after
        self.daemons: dict[str, str] = {}
        """The daemons this worker is registered with: daemon id -> incarnation."""
        self.running: dict[tuple[str, str], RunningAgent] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._beat_task: asyncio.Task[None] | None = None
        self._sub: Any = None
        self._registered = asyncio.Event()
        self._beat_now = asyncio.Event()
        self._registering: set[str] = set()
        self._closing = False
        self._seq = 0

    async def start(self) -> None:
        """Listen for dispatches and start beating: every daemon that hears the beats asks this
        worker to register with it."""
        self.workspace.mkdir(parents=True, exist_ok=True)
        await self.mcp.__aenter__()
        for tool in self.mcp.tools:
            if tool.name in self.tools:
                log.error("MCP tool %s is not offered: a plugin's tool has that name", tool.name)
                continue
            self.tools[tool.name] = tool
        self._sub = await self.nc.subscribe(dispatch_subject(self.worker_id), cb=self._on_dispatch)
        self._beat_task = asyncio.create_task(self._beat_forever(), name=f"beat-{self.worker_id}")

    async def wait_registered(self, timeout: float = 30.0) -> None:
        """Until a first daemon accepted this worker's registration."""
        async with asyncio.timeout(timeout):
            await self._registered.wait()

    async def aclose(self) -> None:
        self._closing = True
        if self._beat_task:
            self._beat_task.cancel()
        for running in list(self.running.values()):
            running.task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(
            *(r.task for r in self.running.values()), *self._tasks, return_exceptions=True
        )
        if self._beat_task:
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat_task
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        await self.mcp.__aexit__(None, None, None)
        for provider in self.providers.values():
            # A provider's pooled HTTP client (the ``openai`` one's); it is made again on use.
            close = getattr(provider, "aclose", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    await close()

    # --- registration and heartbeat --------------------------------------------------------------

    async def register(self, daemon_id: str) -> None:
        """Register with daemon ``daemon_id`` (once; unanswered, the daemon asks again when it
        next hears a beat). Its new incarnation abandons its older dispatches, nobody else's."""
        if daemon_id in self._registering or self._closing:
            return
        self._registering.add(daemon_id)
        try:
            request = Register(
                self.worker_id,
                self.name,
                sorted(self.tools),
                sorted(self.providers),
                pid=os.getpid(),
                instance=self.instance,
                plugins=self.plugin_versions,
                max_agents=self.max_agents,
            )
            try:
                msg = await self.nc.request(
                    control_subject(daemon_id, VERB_REGISTER, self.worker_id),
                    ENCODER.encode(request),
                    timeout=self.request_timeout,
                )
                reply = REGISTER_REPLY_DECODER.decode(msg.data)
            except (TimeoutError, NatsTimeout, NoRespondersError):
                return
            if not reply.ok:
                log.error(
                    "worker %s refused by daemon %s: %s", self.worker_id, daemon_id, reply.reason
                )
                return
            self._abandon(
                daemon_id,
                f"daemon {daemon_id} started again (incarnation {reply.incarnation})",
                keep=reply.incarnation,
            )
            self.daemons[daemon_id] = reply.incarnation
            if reply.heartbeat_interval > 0:
                self._asked_intervals[daemon_id] = reply.heartbeat_interval
                self.heartbeat_interval = min(self._asked_intervals.values())
            self._registered.set()
            self._beat_now.set()
            log.info(
                "worker %s registered with daemon %s (incarnation %s)",
                self.worker_id,
                daemon_id,
                reply.incarnation,
            )
        finally:
            self._registering.discard(daemon_id)

    async def _beat_forever(self) -> None:
        last, waited = time.monotonic(), self.heartbeat_interval
        while True:
            now = time.monotonic()
            if now - last > HELD_UP_BEATS * waited and not self.local_links:
                # (A worker in a daemon's own process shares its event loop: the daemon's work
                # holds both up, and the daemon allows for its own stalls; nothing said here.)
                self._say_held_up(now - last, waited)
            last = now
            self._seq += 1
            beat = Beat(
                self.worker_id,
                self.name,
                daemons=dict(self.daemons),
                agents={f"{s}/{a}": running.epoch for (s, a), running in self.running.items()},
                seq=self._seq,
                max_agents=self.max_agents,
            )
            with contextlib.suppress(Exception):
                await self.nc.publish(beat_subject(self.worker_id), ENCODER.encode(beat))
            # A registration may set a shorter interval than the one being slept: beat at once
            # then, or the daemon's first silence window could close before the next beat.
            waited = self.heartbeat_interval
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(waited):  # not wait_for: see Presence.publish_forever
                    await self._beat_now.wait()
            self._beat_now.clear()

    def _say_held_up(self, gap: float, due: float) -> None:
        """No beat went out for ``gap`` seconds: say so, and what was running (the daemons may
        have declared this worker lost meanwhile and dispatched those agents elsewhere)."""
        running = ", ".join(f"{s}/{a}" for s, a in list(self.running)[:10]) or "nothing"
        log.warning(
            "no heartbeat for %.1f s (one is due every %.1f s): this worker's event loop was held"
            " up, by blocking work in an async tool or plugin or by the process being stopped;"
            " its daemons may have declared it lost and dispatched its agents elsewhere"
            " (running: %s)",
            gap,
            due,
            running,
        )

    def _abandon(self, daemon_id: str, reason: str, keep: str) -> None:
        """Cancel every dispatch daemon ``daemon_id`` sent from another incarnation than ``keep``
        (it may dispatch to us before our registration with it has been answered)."""
        for key, running in list(self.running.items()):
            if running.daemon != daemon_id or running.incarnation == keep:
                continue
            log.warning("abandoning %s: %s", key, reason)
            running.task.cancel()
            del self.running[key]

    # --- dispatch --------------------------------------------------------------------------------

    async def _on_dispatch(self, msg: Msg) -> None:
        ack = self.take_dispatch(msg.data, msg.headers)
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(ENCODER.encode(ack))

    def take_dispatch(self, data: bytes, headers: dict[str, str] | None) -> DispatchAck:
        """Take one encoded dispatch (a ``Run``, ``Cancel`` or ``Reregister``, with the daemon's
        trace headers): start, cancel or register as it asks, and answer whether it was taken.
        Sent on ``apomesh.dispatch.<worker_id>``, or handed over directly by a daemon in this
        process (``WorkerPool.local_workers``)."""
        try:
            message = DISPATCH_DECODER.decode(data)
        except Exception as exc:
            return DispatchAck(False, f"undecodable dispatch: {exc}")
        if isinstance(message, Reregister):
            # Also from an incarnation we know: it asks when it no longer lists us (it declared
            # us lost during a silence), and only a new registration puts us back on its list.
            if message.daemon:
                self._spawn(self.register(message.daemon))
            return DispatchAck(True)
        if isinstance(message, Cancel):
            key = (message.session_id, message.agent)
            current = self.running.get(key)
            if current and current.epoch <= message.epoch:
                current.task.cancel()
                self.running.pop(key, None)
            return DispatchAck(True)
        assert isinstance(message, Run)
        if not message.daemon:
            return DispatchAck(False, "a dispatch must name its daemon")
        if self.daemons.get(message.daemon) != message.incarnation:
            # A dispatch from a daemon we have not registered with yet: take it, then register.
            self._spawn(self.register(message.daemon))
        key = (message.session_id, message.agent)
        old = self.running.get(key)
        if old is not None and old.epoch >= message.epoch:
            return DispatchAck(False, f"epoch {message.epoch} is stale")
        if old is None and len(self.running) >= self.max_agents:
            log.warning(
                "worker %s refused %s/%s from daemon %s: full (%d of %d agents running)",
                self.worker_id,
                message.session_id,
                message.agent,
                message.daemon,
                len(self.running),
                self.max_agents,
            )
            reason = f"full: {len(self.running)} of {self.max_agents} agents running"
            return DispatchAck(False, reason, full=True, beat_seq=self._seq)
        if old is not None:
            old.task.cancel()
        task = asyncio.create_task(
            self._run(message, headers), name=f"agent-{message.session_id}-{message.agent}"
        )
        self.running[key] = RunningAgent(message.epoch, task, message.daemon, message.incarnation)
        log.info(
            "worker %s runs %s/%s epoch %d for daemon %s: %d of %d agents",
            self.worker_id,
            message.session_id,
            message.agent,
            message.epoch,
            message.daemon,
            len(self.running),
            self.max_agents,
        )
        return DispatchAck(True, beat_seq=self._seq)

    async def _run(self, run: Run, headers: dict[str, str] | None = None) -> None:
        """Run one dispatch; ``headers`` are its NATS message's (the daemon's trace context)."""
        key = (run.session_id, run.agent)

        async def send(report: Report) -> Reply:
            return await self.send(report, run.daemon)

        async def publish_delta(turn: TurnDelta) -> None:
            subject = control_subject(run.daemon, VERB_DELTA, self.worker_id)
            for piece in delta_pieces(turn.delta):
                message = msgspec.structs.replace(turn, delta=piece)
                await self.nc.publish(subject, ENCODER.encode(message))

        trace = tracing.dispatch_trace(
            headers,
            {
                "apomesh.session_id": run.session_id,
                "apomesh.agent": run.agent,
                "apomesh.epoch": run.epoch,
                "apomesh.worker_id": self.worker_id,
            },
        )
        outcome = "abandoned"
        try:
            if run.memory_pages:
                run = msgspec.structs.replace(run, memory=await self._fetch_memory(run, send))
            done = await run_agent(
                run,
                worker_id=self.worker_id,
                workspace=self.workspace,
                tools=self.tools,
                providers=self.providers,
                supervisors=self.supervisors,
                send=send,
                trace=trace,
                publish_delta=publish_delta,
            )
            outcome = done.outcome
            await send(done)
        except DaemonGone as exc:
            log.warning("abandoning %s epoch %s: %s", key, run.epoch, exc)
            if self.daemons.get(run.daemon) == run.incarnation:
                # Listed no more in our beats: if it is only slow, it asks us to register again.
                del self.daemons[run.daemon]
        except Fenced as exc:
            outcome = "fenced"
            log.warning("dispatch %s epoch %s fenced off: %s", key, run.epoch, exc)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            outcome = "failed"
            log.exception("agent %s failed", key)
            with contextlib.suppress(Exception):
                await send(
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
            trace.close(outcome)
            current = self.running.get(key)
            if current is not None and current.epoch == run.epoch:
                self.running.pop(key, None)

    async def _fetch_memory(self, run: Run, send: Any) -> AgentMemory:
        """The dispatch's working memory, fetched page by page (it was too large to travel with
        the dispatch); a page the daemon refuses ends the dispatch like any refused report."""
        pages: list[bytes] = []
        for page in range(run.memory_pages):
            fetch = MemoryFetch(self.worker_id, run.session_id, run.agent, run.epoch, page)
            reply = await send(fetch)
            if reply.status == "fenced":
                raise Fenced(reply.message or "this dispatch was fenced off by a newer epoch")
            if reply.status != "ok":
                raise ApomeshError(f"memory page {page} refused: {reply.message}")
            pages.append(reply.data)
        return MEMORY_DECODER.decode(b"".join(pages))

    async def send(self, report: Report, daemon_id: str) -> Reply:
        """Send a report to daemon ``daemon_id``, retrying while it is away (it dedupes
        retries); ``DaemonGone`` once it has not answered for ``daemon_gone_after`` seconds."""
        data = ENCODER.encode(report)
        link = self.local_links.get(daemon_id)
        if link is not None:
            return await link(report, data)
        subject = control_subject(daemon_id, _VERBS[type(report)], self.worker_id)
        started = time.monotonic()
        delay = 0.1
        while True:
            try:
                msg = await self._replies.request(subject, data, timeout=self.request_timeout)
                return REPLY_DECODER.decode(msg.data)
            except (TimeoutError, NatsTimeout, NoRespondersError):
                silent = time.monotonic() - started
                if silent >= self.daemon_gone_after:
                    raise DaemonGone(
                        f"daemon {daemon_id} has not answered {type(report).__name__}"
                        f" for {silent:.0f} s"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _safe(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)
    return cleaned or "worker"
