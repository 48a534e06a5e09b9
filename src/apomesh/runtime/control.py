"""The daemon's control plane: the NATS subscriptions workers talk to, and the one place replies
are sent.

``ControlPlane`` subscribes to this daemon's own control subjects only — registrations
(``apomesh.ctl.<daemon_id>.register.<worker_id>``) and reports
(``apomesh.ctl.<daemon_id>.<verb>.<worker_id>``), so another daemon's reports never reach it —
and to every worker's heartbeats (``apomesh.hb.*``). A request whose reply subject is not the sending worker's own inbox (``_INBOX.worker.<worker_id>.``) is dropped unread
and counted: NATS does not check reply subjects, and the daemon's answer would be published with
its rights (JetStream, KV, the log) wherever the sender chose. It refuses a report
over the size limit, decodes it, checks that the sender bound in the subject is the worker the
report names (fencing by identity), and routes it to its session's writer
(``SessionRuntime.handle_report``, which fences by epoch and decides it); registrations and beats
go to the worker pool. Every answer goes out through ``_reply``. The pieces of model turns being
written (``apomesh.ctl.<daemon_id>.delta.<worker_id>``, published, never requests) go to
``LiveDeltas`` when they belong to a dispatch in flight on their sender, and are dropped otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from apomesh.core.errors import ApomeshError, Fenced, LogUnavailable, StoreUnavailable
from apomesh.runtime.config import LimitsConfig
from apomesh.runtime.live_deltas import LiveDeltas
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.protocol import (
    BEAT_DECODER,
    DELTA_DECODER,
    ENCODER,
    HB_PREFIX,
    MAX_DELTA_BYTES,
    REGISTER_DECODER,
    REPORT_DECODER,
    VERB_DELTA,
    VERB_REGISTER,
    RegisterReply,
    Reply,
    Report,
    answerable,
    beat_subject,
    check_token,
    daemon_control_wildcard,
    subject_verb,
    subject_worker,
)
from apomesh.runtime.sessions import Held, SessionRuntime
from apomesh.runtime.workers import WorkerPool

log = logging.getLogger("apomesh.daemon")

REPORT_RETRY_SECONDS = 30.0
"""How long a report is asked of its session's writer again while NATS does not answer what
the writer needs for it (then the dispatch is fenced off and the agent dispatched again)."""


class ControlPlane:
    """The ``ctl.*`` and heartbeat subscriptions; see the module docstring."""

    def __init__(
        self,
        *,
        nc: NATS,
        limits: LimitsConfig,
        workers: WorkerPool,
        route: Callable[[str], SessionRuntime | None],
        metrics: DaemonMetrics,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
        deltas: LiveDeltas | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.nc = nc
        self.limits = limits
        self.workers = workers
        self.route = route
        self.metrics = metrics
        self.spawn = spawn
        self.deltas = deltas if deltas is not None else LiveDeltas()
        self.log = logger or log
        self._subs: list[Any] = []
        self._beat_sub: Any = None

    async def start(self) -> None:
        """Subscribe; ``workers.daemon_id`` is this daemon's stable id by now."""
        daemon_id = check_token(self.workers.daemon_id, "daemon id")
        self._subs.append(
            await self.nc.subscribe(
                daemon_control_wildcard(daemon_id, VERB_REGISTER), cb=self._on_register
            )
        )
        self._subs.append(
            await self.nc.subscribe(daemon_control_wildcard(daemon_id), cb=self._on_report)
        )
        self._beat_sub = await self.nc.subscribe(HB_PREFIX + "*", cb=self._on_beat)
        self._subs.append(self._beat_sub)

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def pending_beats(self) -> int:
        """Beats received but not read yet (never silence: liveness reads them first)."""
        return int(self._beat_sub.pending_msgs) if self._beat_sub is not None else 0

    # --- registrations and beats -----------------------------------------------------------------

    def _answerable(self, msg: Msg) -> bool:
        """Whether to read and answer a control request at all (see the module docstring)."""
        if answerable(msg.subject, msg.reply):
            return True
        self.metrics.dropped_requests.inc()
        self.log.warning(
            "dropped a request on %s: its reply subject %r is not that worker's inbox",
            msg.subject,
            msg.reply[:200],
        )
        return False

    async def _on_register(self, msg: Msg) -> None:
        if not self._answerable(msg):
            return
        try:
            reg = REGISTER_DECODER.decode(msg.data)
        except Exception as exc:
            await _reply(
                msg,
                RegisterReply(
                    False, reason=f"undecodable registration: {exc}", daemon=self.workers.daemon_id
                ),
            )
            return
        sender = subject_worker(msg.subject)
        if sender is not None and sender != reg.worker_id:
            self.log.warning(
                "refused a registration as %s sent by worker %s", reg.worker_id, sender
            )
            await _reply(
                msg,
                RegisterReply(False, reason=f"worker {sender} cannot register as {reg.worker_id}"),
            )
            return
        reply = await self.workers.register(reg)
        await _reply(msg, reply)
        if reply.ok:
            await self.workers.registered()

    async def _on_beat(self, msg: Msg) -> None:
        try:
            beat = BEAT_DECODER.decode(msg.data)
        except Exception:
            return
        if msg.subject != beat_subject(beat.worker_id):
            self.log.warning("ignored a beat naming worker %s on %s", beat.worker_id, msg.subject)
            return
        await self.workers.beat(beat)

    # --- reports from workers --------------------------------------------------------------------

    async def _on_report(self, msg: Msg) -> None:
        verb = subject_verb(msg.subject)
        if verb == VERB_REGISTER:
            return  # registrations have their own subscription
        if verb == VERB_DELTA:
            self._on_delta(msg)
            return
        if self._answerable(msg):
            # nats-py runs one subscription's callbacks one after another: hand each report to
            # its own task so sessions proceed concurrently (one agent's reports are sequential
            # requests anyway).
            self.spawn(self._process_report(msg))

    def _on_delta(self, msg: Msg) -> None:
        """A piece of a model turn: passed on to the session's live streams only when its
        sender is the worker it names and this daemon's dispatch of it, under its epoch, is in
        flight there; anything else is dropped unanswered (it is only a preview)."""
        if len(msg.data) > MAX_DELTA_BYTES:
            return
        try:
            delta = DELTA_DECODER.decode(msg.data)
        except Exception:
            return
        if subject_worker(msg.subject) != delta.worker_id or not self.workers.runs(
            delta.worker_id, delta.session_id, delta.agent, delta.epoch
        ):
            self.metrics.fenced_reports.inc()
            return
        self.deltas.publish(delta)

    async def _process_report(self, msg: Msg) -> None:
        await _reply(msg, await self.answer(msg.data, subject_worker(msg.subject)))

    def _report_ceiling(self) -> int:
        """The largest report taken at all, in bytes encoded."""
        limits = self.limits
        return (
            max(limits.max_snapshot_bytes, limits.max_event_bytes, limits.max_tool_args_bytes)
            + 4096
        )

    async def answer(self, data: bytes, sender: str | None) -> Reply:
        """The reply to one encoded report sent by worker ``sender``: refused when it is over the
        size ceiling, undecodable, or names another worker; otherwise its session writer's."""
        ceiling = self._report_ceiling()
        if len(data) > ceiling:
            self.log.warning(
                "refused a report of %d bytes from %s (limit %d)", len(data), sender, ceiling
            )
            message = (
                f"payload_too_large: a report of {len(data)} bytes is over the limit of {ceiling}"
            )
            return Reply("error", message=message)
        try:
            report = REPORT_DECODER.decode(data)
        except Exception as exc:
            return Reply("error", message=f"undecodable report: {exc}")
        return await self._answer_report(report, len(data), sender)

    async def _answer_report(self, report: Report, size: int, sender: str | None) -> Reply:
        """The reply to a decoded report of ``size`` bytes encoded, sent by worker ``sender``."""
        if sender is not None and sender != report.worker_id:
            self.metrics.fenced_reports.inc()
            self.log.warning(
                "fenced %s naming worker %s sent by worker %s",
                type(report).__name__,
                report.worker_id,
                sender,
            )
            return Reply("fenced", message=f"worker {sender} cannot report as {report.worker_id}")
        return await self._decide(report, size)

    def local_link(self, worker_id: str) -> Callable[[Report, bytes], Awaitable[Reply]]:
        """How an in-process worker (same process, same event loop) sends its reports to this
        daemon without a NATS round trip: the report and its encoding (whose size the limits
        are checked against; the report itself is taken as it is, not decoded again), the same
        checks and writer as a report on the worker's control subjects, answered in a task of
        the daemon's own (a worker cancelling its call never cuts the daemon's handling short,
        as with a request over NATS)."""

        async def send(report: Report, data: bytes) -> Reply:
            size = len(data)
            if size > self._report_ceiling():
                return await self.answer(data, worker_id)  # refused, as over NATS
            answering = self._answer_report(report, size, worker_id)
            task: asyncio.Future[Reply] = asyncio.ensure_future(answering)
            return await asyncio.shield(task)

        return send

    async def _decide(self, report: Report, size: int) -> Reply:
        """The reply to a report (``size`` bytes encoded) from its session's writer (fenced when
        nobody here drives it)."""
        runtime = self.route(report.session_id)
        try:
            if runtime is None:
                self.log.warning(
                    "fenced %s from %s for %s/%s: the session is not driven here",
                    type(report).__name__,
                    report.worker_id,
                    report.session_id,
                    report.agent,
                )
                reply = Reply(
                    "fenced", message=f"epoch {report.epoch} of {report.agent} is not current"
                )
            else:
                reply = await self._when_nats_answers(runtime, report, size)
        except Held as exc:
            reply = Reply("ok", decision="hold", message=str(exc))
        except Fenced as exc:
            self.log.warning(
                "fenced %s from %s: %s", type(report).__name__, report.worker_id, exc.message
            )
            reply = Reply("fenced", message=exc.message)
        except (LogUnavailable, StoreUnavailable) as exc:
            # Not an error of the agent's: its dispatch stops here, as if cut off, and the
            # session dispatches it again from its last stored node (or the next daemon does).
            self.log.warning(
                "fenced %s from %s: NATS did not answer (%s)",
                type(report).__name__,
                report.worker_id,
                exc.message,
            )
            reply = Reply("fenced", message=f"NATS did not answer the daemon: {exc.message}")
        except ApomeshError as exc:
            reply = Reply("error", message=exc.message)
        except Exception as exc:
            self.log.exception("report %s failed", type(report).__name__)
            reply = Reply("error", message=f"{type(exc).__name__}: {exc}")
        if reply.status == "fenced":
            self.metrics.fenced_reports.inc()
        return reply

    async def _when_nats_answers(self, runtime: SessionRuntime, report: Report, size: int) -> Reply:
        """``runtime.handle_report``, asked again while NATS does not answer what it needs (as a
        worker's resend after a lost reply is: the writer settles a report it took already),
        up to ``REPORT_RETRY_SECONDS``, and not once the writer drains or was retired."""
        deadline = asyncio.get_running_loop().time() + REPORT_RETRY_SECONDS
        delay = 0.1
        while True:
            try:
                return await runtime.handle_report(report, size)
            except (LogUnavailable, StoreUnavailable):
                late = asyncio.get_running_loop().time() + delay > deadline
                if late or runtime.draining or runtime.stopped:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def _reply(msg: Msg, payload: Any) -> None:
    """The one way the daemon answers a worker's request."""
    if msg.reply:
        with contextlib.suppress(Exception):
            await msg.respond(ENCODER.encode(payload))
