"""The daemon's orchestrator: live sessions, the worker registry, the control plane, liveness by
heartbeat and the boot scan that recovers sessions after a restart.

``Daemon`` owns no sockets of its own beyond one NATS connection: it is handed the event log, the
heartbeat stream, the KV buckets, the LMDB store and the plugin host (``apomesh.runtime.serve``
builds them). It answers worker reports on ``apomesh.ctl.<verb>.<worker_id>`` (fenced by epoch and
worker identity; answered only on that worker's own inbox),
decides which events to append, dispatches agents, declares workers lost after missed beats (never
while it is itself reconnecting), and at boot classifies every session it finds on the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.adapters.private_files import read_private_file, write_private_file
from apomesh.core import decisions
from apomesh.core.definition import AgentConfig
from apomesh.core.errors import ApomeshError, CodecError, CorruptPin, Fenced, FoldError, NotFound
from apomesh.core.events import (
    AsyncJobFinished,
    AsyncJobStarted,
    HitlAnswered,
    HitlPaused,
    OperatorAction,
    SessionShape,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.state import SessionState, fold
from apomesh.core.views import VerificationView
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.config import Config
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.pinning import (
    check_shape,
    corrupt_bootstrap,
    plan_agent_migration,
    plan_migration,
    shape_problem,
)
from apomesh.runtime.protocol import (
    BEAT_DECODER,
    CTL_BOUND_WILDCARD,
    DISPATCH_ACK_DECODER,
    ENCODER,
    HB_PREFIX,
    REGISTER_DECODER,
    REPORT_DECODER,
    SUBJECT_REGISTER,
    Cancel,
    Done,
    HitlAsk,
    JobStart,
    JournalBegin,
    JournalFinish,
    NodeReport,
    RegisterReply,
    Reply,
    Report,
    Reregister,
    Run,
    answerable,
    beat_subject,
    dispatch_subject,
    subject_worker,
)
from apomesh.runtime.sessions import Held, SessionRuntime, WorkerLost
from apomesh.runtime.snapshots import SnapshotStore

log = logging.getLogger("apomesh.daemon")

LOST_WORKERS_KEPT = 64
"""How many workers declared lost the daemon keeps listing (``GET /v1/workers``, ``alive`` false)."""


@dataclass
class WorkerInfo:
    worker_id: str
    name: str
    tools: list[str]
    providers: list[str]
    last_seen: float
    last_beat_wall: float
    agents: list[str] = field(default_factory=list)
    load: int = 0
    instance: str = ""


@dataclass
class Recoverable:
    session_id: str
    goal: str
    reason: str
    category: str
    side_effects: int
    last_event_at: float
    state: SessionState | None = None
    error: ApomeshError | None = None  # why a session without a folded state cannot be resumed


class CompletedRecord(msgspec.Struct):
    session_id: str
    status: str
    goal: str
    output: str | None
    reason: str | None
    last_index: int
    started_at: float
    ended_at: float
    side_effects: int


_completed_decoder = msgspec.msgpack.Decoder(CompletedRecord)


class Daemon:
    """The orchestrator. Build it with its adapters, then ``await start()``; ``aclose()`` stops it."""

    def __init__(
        self,
        config: Config,
        *,
        nc: NATS,
        control_nc: NATS | None = None,
        log_adapter: Any,
        heartbeats: Any,
        kv: Any,
        store: AsyncStore,
        plugins: PluginHost,
        workspace: Path,
    ) -> None:
        self.config = config
        self.nc = nc
        # Worker requests are answered, and dispatches sent, on the control-plane connection
        # (no JetStream, KV or log rights) when there is one.
        self.control_nc = control_nc or nc
        self.log = log_adapter
        self.heartbeats = heartbeats
        self.kv = kv
        self.store = store
        self.plugins = plugins
        self.workspace = workspace
        self.incarnation = uuid.uuid4().hex[:12]
        self.daemon_id = self.incarnation  # replaced by the data dir's stable id in start()
        self.snapshots = SnapshotStore(store, compact_every=config.snapshots.compact_every)
        self.metrics = DaemonMetrics()
        self.fenced_total = self.metrics.registry.counter(
            "apomesh_fenced_reports_total", "Worker reports rejected for a stale epoch or identity."
        )
        self.dropped_requests = self.metrics.registry.counter(
            "apomesh_control_requests_dropped_total",
            "Control requests dropped unanswered: not on a worker's bound subject, or with a reply"
            " subject outside that worker's own inbox.",
        )
        self.snapshot_bytes = self.metrics.registry.counter(
            "apomesh_snapshot_bytes_total", "Bytes of snapshot records written to LMDB."
        )
        self.sessions: dict[str, SessionRuntime] = {}
        self.recoverable: dict[str, Recoverable] = {}
        self.workers: dict[str, WorkerInfo] = {}
        # Workers declared lost, newest last, listed as such until they register again.
        self.lost_workers: dict[str, WorkerInfo] = {}
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._journal_copies: dict[str, set[asyncio.Task[Any]]] = {}
        self._reregister_sent: dict[str, float] = {}
        self._reconnected_at = time.monotonic()
        self._was_connected = True
        self.boot_report: dict[str, Any] = {}
        self.interval = config.liveness.heartbeat_interval
        self.threshold = config.liveness.heartbeat_interval * config.liveness.missed_beats
        self._closing = False
        self._dispatch_refused: dict[str, float] = {}
        self._waiting_for_lease: set[str] = set()

    @property
    def closing(self) -> bool:
        """True once ``aclose`` began: nothing waits for the log any more."""
        return self._closing

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self, *, recover: bool = True) -> None:
        self.daemon_id = await self._stable_id()
        await self.log.ensure()
        await self.heartbeats.ensure()
        control = self.control_nc
        self._subs.append(await control.subscribe(SUBJECT_REGISTER + ".*", cb=self._on_register))
        self._subs.append(await control.subscribe(CTL_BOUND_WILDCARD, cb=self._on_report))
        self._beat_sub = await control.subscribe(HB_PREFIX + "*", cb=self._on_beat)
        self._subs.append(self._beat_sub)
        self._spawn(self._liveness_forever())
        self._spawn(self._lease_renewal_forever())
        with contextlib.suppress(Exception):
            for worker_id in await self.heartbeats.latest():
                await self._ask_reregister(worker_id, force=True)
        if recover:
            await self.boot_scan()

    async def _stable_id(self) -> str:
        """The data dir's daemon identity (the owner name of its session leases). Kept in a file
        beside LMDB as well as in it, so a lost LMDB does not strand the sessions this daemon
        leased until their leases expire."""
        id_file = self.config.daemon.data_path() / "daemon.id"
        stored = await self.store.get("meta", "daemon_id")
        from_file = None
        with contextlib.suppress(OSError, UnicodeDecodeError):
            from_file = read_private_file(id_file).decode("utf-8").strip() or None
        daemon_id = from_file or (stored.decode() if stored is not None else self.daemon_id)
        if stored is None or stored.decode() != daemon_id:
            await self.store.write_batch([("meta", "daemon_id", daemon_id.encode())])
        if from_file != daemon_id:
            with contextlib.suppress(OSError):
                # 0600, and never through a symlink planted at that name.
                write_private_file(id_file, (daemon_id + "\n").encode())
        return daemon_id

    async def aclose(self) -> None:
        self._closing = True
        # Leases are not given back here: they expire by themselves, and this daemon (its id is
        # kept in the data dir) takes its own back at once when it starts again. A release request
        # left unanswered while NATS is going away must never hold the shutdown.
        for runtime in list(self.sessions.values()):
            await runtime.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- sessions ----------------------------------------------------------------------------------

    async def kv_lease(self, session_id: str) -> bool:
        return bool(await self.kv.leases.acquire(session_id, self.daemon_id))

    def next_child_ref(self, state: SessionState, parent: str) -> str:
        return decisions.next_child_ref(state, parent)

    async def adopt(
        self,
        state: SessionState,
        *,
        recovered: Literal["auto", "operator"] | None,
        fresh_children: bool,
    ) -> SessionRuntime:
        """Take ownership of a session (lease) and start driving it."""
        if not await self.kv.leases.acquire(state.session_id, self.daemon_id):
            raise ApomeshError(f"session {state.session_id} is driven by another daemon")
        runtime = SessionRuntime(self, state, fresh_children=fresh_children)
        self.sessions[state.session_id] = runtime
        runtime.start(recovered)
        return runtime

    async def session_finished(self, runtime: SessionRuntime) -> None:
        state = runtime.state
        await self.write_completed(state)
        self.sessions.pop(state.session_id, None)
        self.recoverable.pop(state.session_id, None)
        with contextlib.suppress(Exception):
            await self.kv.leases.release(state.session_id, self.daemon_id)
        for ref in state.agents:
            self.snapshots.forget(f"{state.session_id}/{ref}")

    async def write_completed(self, state: SessionState) -> None:
        assert state.ended is not None
        record = CompletedRecord(
            session_id=state.session_id,
            status=state.ended.status,
            goal=state.goal,
            output=state.output,
            reason=state.ended.reason,
            last_index=state.last_index,
            started_at=state.started_ts,
            ended_at=state.last_ts,
            side_effects=state.side_effects,
        )
        await self.store.put_completed(state.session_id, msgspec.msgpack.encode(record))

    async def completed_records(self) -> list[CompletedRecord]:
        return [_completed_decoder.decode(v) for _, v in await self.store.list_completed()]

    def mark_recoverable(self, runtime: SessionRuntime, reason: str, category: str) -> None:
        state = runtime.state
        self.sessions.pop(state.session_id, None)
        self.recoverable[state.session_id] = Recoverable(
            state.session_id, state.goal, reason, category, state.side_effects, state.last_ts, state
        )
        self._spawn(self.kv.leases.release(state.session_id, self.daemon_id))

    async def load_state(self, session_id: str) -> SessionState:
        """The folded state of any session: live in memory, else read from the log."""
        runtime = self.sessions.get(session_id)
        if runtime is not None:
            return runtime.state
        rec = self.recoverable.get(session_id)
        if rec is not None and rec.state is not None:
            return rec.state
        envelopes = await self.log.read(session_id)
        if not envelopes:
            raise NotFound(f"session {session_id}")
        return fold(envelopes, session_id)

    async def verify(self, session_id: str) -> VerificationView:
        """Fold the session's log from its start and check it against the stored snapshots,
        journal and completed record (see ``apomesh.runtime.verify``)."""
        from apomesh.runtime.verify import verify_session

        return await verify_session(self.log, self.store, session_id)

    # --- boot scan -----------------------------------------------------------------------------------

    async def boot_scan(self) -> dict[str, Any]:
        """Classify every session on the log; auto-resume the safe ones, list the others."""
        started = time.perf_counter()
        completed = {sid for sid, _ in await self.store.list_completed()}
        session_ids = [s for s in await self.log.list_sessions() if s not in completed]
        gate = asyncio.Semaphore(32)
        counts: dict[str, float] = {
            "completed_skipped": len(completed),
            "terminal": 0,
            "auto_resume": 0,
            "recoverable": 0,
            "undecodable": 0,
        }
        scanned = await self._fold_in_one_pass(completed)

        async def one(session_id: str) -> None:
            state = scanned.pop(session_id, None)
            async with gate:
                try:
                    if state is None:
                        state = fold(await self.log.read(session_id), session_id)
                except (CodecError, FoldError) as exc:
                    corrupt = (
                        await self._corrupt_bootstrap(session_id)
                        if exc.index in (0, None)
                        else None
                    )
                    if corrupt is not None:
                        log.error(
                            "session %s is stranded by a corrupt pin: %s", session_id, corrupt
                        )
                        counts["recoverable"] += 1
                        self.recoverable[session_id] = Recoverable(
                            session_id,
                            "",
                            f"{decisions.REASON_PIN_MISMATCH}: {corrupt.message}",
                            "pin_mismatch",
                            0,
                            0.0,
                            error=corrupt,
                        )
                        return
                    log.error("session %s cannot be decoded whole: %s", session_id, exc)
                    counts["undecodable"] += 1
                    self.recoverable[session_id] = Recoverable(
                        session_id,
                        "",
                        f"{decisions.REASON_UNDECODABLE}: {exc}",
                        "undecodable",
                        0,
                        0.0,
                    )
                    return
            if state.terminal:
                counts["terminal"] += 1
                await self.write_completed(state)
                return
            verdict = self.classify(state)
            if verdict.verdict == "auto_resume":
                counts["auto_resume"] += 1
                try:
                    await self.adopt(state, recovered="auto", fresh_children=True)
                except ApomeshError as exc:
                    log.warning("session %s not resumed yet: %s; trying again", session_id, exc)
                    self._spawn(self._adopt_when_free(state))
                return
            counts["recoverable"] += 1
            self.recoverable[session_id] = Recoverable(
                session_id,
                state.goal,
                verdict.reason,
                verdict.category,
                state.side_effects,
                state.last_ts,
                state,
            )

        await asyncio.gather(*(one(s) for s in session_ids))
        counts["seconds"] = round(time.perf_counter() - started, 3)
        self.boot_report = counts
        log.info("boot scan: %s", counts)
        return counts

    async def _fold_in_one_pass(self, completed: set[str]) -> dict[str, SessionState]:
        """Every session folded in one pass over the log stream (``apomesh.runtime.boot``), when
        the log is JetStream; the sessions the pass cannot vouch for are left out (read one by
        one)."""
        stream, prefix = (
            getattr(self.log, "stream", None),
            getattr(self.log, "subject_prefix", None),
        )
        if not isinstance(stream, str) or not isinstance(prefix, str):
            return {}
        from apomesh.runtime.boot import fold_stream

        try:
            result = await fold_stream(self.nc, stream, prefix, skip=completed)
        except ApomeshError as exc:
            log.warning(
                "boot scan: one pass over the log failed (%s); reading sessions one by one", exc
            )
            return {}
        log.info(
            "boot scan: %d events folded in one pass (%d pages), %d sessions, %d to read one by one",
            result.events,
            result.pages,
            len(result.states),
            len(result.suspect),
        )
        return result.states

    async def _corrupt_bootstrap(self, session_id: str) -> CorruptPin | None:
        """The corrupt pin that makes a session's ``SessionStarted`` undecodable, if that is why."""
        with contextlib.suppress(Exception):
            first = await self.log.read_raw(session_id, -1)
            if first:
                return corrupt_bootstrap(first[0][1])
        return None

    async def _adopt_when_free(self, state: SessionState) -> None:
        """Auto-resume a session whose lease another owner still holds, once it expires (a
        daemon that died holding it) or is released."""
        session_id = state.session_id
        self._waiting_for_lease.add(session_id)
        try:
            while not self._closing and session_id not in self.sessions:
                await asyncio.sleep(2.0)
                try:
                    await self.adopt(state, recovered="auto", fresh_children=True)
                    log.info("session %s resumed after its lease came free", session_id)
                    return
                except ApomeshError as exc:
                    log.debug("session %s still waits: %s", session_id, exc)
        finally:
            self._waiting_for_lease.discard(session_id)

    def classify(self, state: SessionState) -> decisions.Classification:
        problem = shape_problem(self.plugins, state) if state.bootstrap is not None else None
        tools = self.plugins.tools()
        for classifier in self.plugins.recovery_classifiers():
            verdict = classifier.classify(state, problem, tools)
            if verdict is not None:
                return verdict
        return decisions.classify(state, problem)

    # --- operator actions ---------------------------------------------------------------------------

    async def resume(
        self,
        session_id: str,
        *,
        by: str,
        migrate_pins: dict[str, str] | None = None,
        agent_shape: SessionShape | None = None,
    ) -> None:
        """Resume a session from the recoverable list (``OperatorAction(resume)``), first moving
        its plugin pins (``migrate_pins``, name -> installed version) and/or its agent to another
        published version (``agent_shape``, composed from that version's sealed bundle), each move
        logged as ``OperatorAction(migrate_pin)``."""
        rec = self.recoverable.get(session_id)
        if rec is None:
            if session_id in self.sessions:
                raise ApomeshError(f"session {session_id} is already running")
            raise NotFound(f"recoverable session {session_id}")
        if rec.state is None:
            if rec.error is not None:
                raise rec.error
            raise ApomeshError(f"session {session_id} cannot be resumed: {rec.reason}")
        state = rec.state
        if state.bootstrap is None:
            raise ApomeshError(
                f"session {session_id} has no durable SessionStarted; it cannot be resumed"
            )
        # A pin that cannot be satisfied is a typed error naming it; a migration is checked whole
        # before anything is logged.
        moved_from: dict[str, str] = {}
        migration: dict[str, Any] | None = None
        if agent_shape is not None:
            migration = plan_agent_migration(self.plugins, state, agent_shape, migrate_pins)
        elif migrate_pins:
            moved_from = plan_migration(self.plugins, state, migrate_pins)
            migration = {"pins": dict(migrate_pins), "from": moved_from}
        else:
            check_shape(self.plugins, state)
        del self.recoverable[session_id]
        try:
            runtime = SessionRuntime(self, state, fresh_children=False)
            if not await self.kv.leases.acquire(session_id, self.daemon_id):
                raise ApomeshError(f"session {session_id} is driven by another daemon")
            self.sessions[session_id] = runtime
            if migration is not None:
                await runtime.append(OperatorAction(action="migrate_pin", by=by, detail=migration))
            await runtime.append(
                OperatorAction(
                    action="resume",
                    by=by,
                    detail={"unknown_outcomes": len(state.unknown_outcomes), "reason": rec.reason},
                )
            )
            runtime.start("operator")
        except BaseException:
            self.sessions.pop(session_id, None)
            self.recoverable[session_id] = rec
            raise

    async def cancel(self, session_id: str, *, by: str) -> None:
        runtime = self.sessions.get(session_id)
        if runtime is None:
            rec = self.recoverable.get(session_id)
            state = rec.state if rec else None
            if state is None:
                state = await self.load_state(session_id)
            if state.terminal:
                raise ApomeshError(f"session {session_id} has already ended ({state.status})")
            runtime = SessionRuntime(self, state)
            self.recoverable.pop(session_id, None)
        await runtime.append(OperatorAction(action="cancel", by=by))
        await runtime.cancel(f"cancelled by {by}")

    async def answer_hitl(self, session_id: str, pause_id: str, answer: str, *, by: str) -> None:
        runtime = self.sessions.get(session_id)
        state = runtime.state if runtime else await self.load_state(session_id)
        if pause_id not in state.hitl_pending:
            if pause_id in state.hitl_answers:
                raise NotFound(f"pause {pause_id} is not open: it was already answered")
            raise NotFound(f"open pause {pause_id} in session {session_id}")
        if runtime is None:
            raise ApomeshError(f"session {session_id} is not running here; resume it first")
        await runtime.append(HitlAnswered(pause_id=pause_id, answer=answer, by=by))

    # --- workers -------------------------------------------------------------------------------------

    async def _on_register(self, msg: Msg) -> None:
        if not self._answerable(msg):
            return
        try:
            reg = REGISTER_DECODER.decode(msg.data)
        except Exception as exc:
            await _reply(msg, RegisterReply(False, reason=f"undecodable registration: {exc}"))
            return
        sender = subject_worker(msg.subject)
        if sender is not None and sender != reg.worker_id:
            log.warning("refused a registration as %s sent by worker %s", reg.worker_id, sender)
            await _reply(
                msg,
                RegisterReply(False, reason=f"worker {sender} cannot register as {reg.worker_id}"),
            )
            return
        allowed_tools = set(self.config.workers.allowed_tools)
        allowed_providers = set(self.config.workers.allowed_providers)
        bad = [t for t in reg.tools if allowed_tools and t not in allowed_tools]
        bad += [p for p in reg.providers if allowed_providers and p not in allowed_providers]
        if bad:
            log.warning("refused worker %s: not allowed: %s", reg.worker_id, ", ".join(bad))
            await _reply(
                msg,
                RegisterReply(
                    False, reason=f"not allowed by the daemon's config: {', '.join(bad)}"
                ),
            )
            return
        known = self.workers.get(reg.worker_id)
        if known is not None and known.instance and reg.instance and known.instance != reg.instance:
            # The same identity from a new process: whatever the old one ran died with it.
            await self.worker_lost(reg.worker_id, "it registered again from a new process")
            known = None
        now = time.monotonic()
        self.workers[reg.worker_id] = WorkerInfo(
            reg.worker_id,
            reg.name,
            reg.tools,
            reg.providers,
            now,
            time.time(),
            load=known.load if known else 0,
            instance=reg.instance,
        )
        self.lost_workers.pop(reg.worker_id, None)
        log.info("worker %s (%s) registered", reg.worker_id, reg.name)
        await _reply(
            msg, RegisterReply(True, incarnation=self.incarnation, heartbeat_interval=self.interval)
        )
        await self._wake_all()

    async def _on_beat(self, msg: Msg) -> None:
        try:
            beat = BEAT_DECODER.decode(msg.data)
        except Exception:
            return
        if msg.subject != beat_subject(beat.worker_id):
            log.warning("ignored a beat naming worker %s on %s", beat.worker_id, msg.subject)
            return
        self.metrics.heartbeats_received.inc()
        worker = self.workers.get(beat.worker_id)
        if worker is None or beat.incarnation_seen != self.incarnation:
            await self._ask_reregister(beat.worker_id)
            if worker is None:
                return
        worker.last_seen = time.monotonic()
        worker.last_beat_wall = time.time()
        worker.agents = list(beat.agents)

    async def _ask_reregister(self, worker_id: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._reregister_sent.get(worker_id, 0.0) < max(1.0, self.interval):
            return
        self._reregister_sent[worker_id] = now
        with contextlib.suppress(Exception):
            await self.control_nc.publish(
                dispatch_subject(worker_id), ENCODER.encode(Reregister(self.incarnation))
            )

    async def pick_worker(self, config: AgentConfig, prefer: str | None = None) -> str:
        """A live registered worker that has the agent's model provider and tools (waits for one)."""
        while True:
            fresh = time.monotonic() - self.threshold
            candidates = [
                w
                for w in self.workers.values()
                if w.last_seen >= fresh
                and config.model.provider in w.providers
                and all(t in w.tools for t in config.tools)
            ]
            # A worker that just refused or missed a dispatch is passed over while another can
            # take it (it is not declared lost for that: liveness alone decides).
            now = time.monotonic()
            answering = [
                w
                for w in candidates
                if now - self._dispatch_refused.get(w.worker_id, -1e9) > self.threshold
            ]
            candidates = answering or candidates
            if candidates:
                if (
                    config.affinity == "sticky"
                    and prefer
                    and prefer in self.workers
                    and prefer in [w.worker_id for w in candidates]
                ):
                    self.workers[prefer].load += 1
                    return prefer
                chosen = min(candidates, key=lambda w: (w.load, w.worker_id))
                chosen.load += 1
                return chosen.worker_id
            await asyncio.sleep(0.1)

    def release_worker(self, worker_id: str) -> None:
        """A dispatch picked for ``worker_id`` ended (answered, lost or refused)."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.load = max(0, worker.load - 1)

    async def send_run(self, worker_id: str, run: Run) -> bool:
        try:
            msg = await self.control_nc.request(
                dispatch_subject(worker_id), ENCODER.encode(run), timeout=5.0
            )
            ack = DISPATCH_ACK_DECODER.decode(msg.data)
        except Exception as exc:  # an RPC failure is never proof of death; liveness decides that
            log.warning(
                "dispatch of %s/%s to %s not acknowledged: %r",
                run.session_id,
                run.agent,
                worker_id,
                exc,
            )
            self._dispatch_refused[worker_id] = time.monotonic()
            return False
        if not ack.ok:
            log.warning(
                "worker %s refused dispatch %s/%s: %s",
                worker_id,
                run.session_id,
                run.agent,
                ack.reason,
            )
            self._dispatch_refused[worker_id] = time.monotonic()
            return False
        self._dispatch_refused.pop(worker_id, None)
        return True

    async def send_cancel(
        self, worker_id: str, session_id: str, agent: str, epoch: int, reason: str
    ) -> None:
        await self.control_nc.publish(
            dispatch_subject(worker_id), ENCODER.encode(Cancel(session_id, agent, epoch, reason))
        )

    async def _liveness_forever(self) -> None:
        tick = min(self.interval / 4, 0.25)
        last_tick = time.monotonic()
        deferred_since: float | None = None
        while True:
            await asyncio.sleep(tick)
            if self._closing:
                return  # a daemon shutting down judges nobody
            connected = self.nc.is_connected
            now = time.monotonic()
            stalled = now - last_tick - tick
            last_tick = now
            if stalled > self.interval / 2:
                # Our own event loop was too busy to listen (a boot scan, a burst): the time we
                # were deaf is nobody's silence.
                for w in self.workers.values():
                    w.last_seen += stalled
                continue
            beats = getattr(self, "_beat_sub", None)
            if beats is not None and beats.pending_msgs > 0:
                # Beats we received but have not read yet are not silence: read them first, for
                # up to one interval (a queue that never drains must not stop all judgement).
                deferred_since = now if deferred_since is None else deferred_since
                if now - deferred_since < self.interval:
                    continue
            deferred_since = None
            if not connected:
                self._was_connected = False
                continue
            if not self._was_connected:
                # We were the ones cut off: nobody is judged on silence we could not hear.
                self._was_connected = True
                self._reconnected_at = now
                log.info(
                    "reconnected to NATS: workers get %.1f s to be heard again", 2 * self.threshold
                )
                for w in self.workers.values():
                    w.last_seen = now
                continue
            if now - self._reconnected_at < self.threshold:
                # Workers reconnect on their own schedule after a server restart: one more
                # threshold of grace before their silence counts.
                continue
            for worker in list(self.workers.values()):
                if now - worker.last_seen > self.threshold:
                    await self.worker_lost(
                        worker.worker_id, f"missed {self.config.liveness.missed_beats} heartbeats"
                    )

    async def worker_lost(self, worker_id: str, reason: str) -> None:
        """Unregister the worker and re-dispatch everything it was running."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return
        self.lost_workers.pop(worker_id, None)
        self.lost_workers[worker_id] = worker
        while len(self.lost_workers) > LOST_WORKERS_KEPT:
            del self.lost_workers[next(iter(self.lost_workers))]
        self.metrics.workers_lost.inc()
        log.warning("worker %s lost: %s", worker_id, reason)
        for runtime in list(self.sessions.values()):
            for slot in list(runtime.slots.values()):
                if slot.worker_id == worker_id and not slot.future.done():
                    with contextlib.suppress(Exception):
                        await self.send_cancel(
                            worker_id,
                            runtime.session_id,
                            slot.agent,
                            slot.epoch,
                            "worker declared lost",
                        )
                    slot.future.set_exception(
                        WorkerLost(worker_id, f"worker {worker_id} lost: {reason}")
                    )

    async def _wake_all(self) -> None:
        for runtime in list(self.sessions.values()):
            await runtime.poke()

    # --- reports from workers ------------------------------------------------------------------------

    def _answerable(self, msg: Msg) -> bool:
        """Whether to read and answer a control request at all. One whose reply subject is not
        the sending worker's own inbox is dropped unread: the daemon's answer would be
        published with its rights (JetStream, KV, the log) wherever the sender chose."""
        if answerable(msg.subject, msg.reply):
            return True
        self.dropped_requests.inc()
        log.warning(
            "dropped a request on %s: its reply subject %r is not that worker's inbox",
            msg.subject,
            msg.reply[:200],
        )
        return False

    async def _on_report(self, msg: Msg) -> None:
        if msg.subject.startswith(SUBJECT_REGISTER + "."):
            return  # registrations have their own subscription
        if self._answerable(msg):
            # nats-py runs one subscription's callbacks one after another: hand each report to
            # its own task so sessions proceed concurrently (one agent's reports are sequential
            # requests anyway).
            self._spawn(self._process_report(msg))

    async def _process_report(self, msg: Msg) -> None:
        limits = self.config.limits
        ceiling = (
            max(limits.max_snapshot_bytes, limits.max_event_bytes, limits.max_tool_args_bytes)
            + 4096
        )
        if len(msg.data) > ceiling:
            log.warning(
                "refused a report of %d bytes on %s (limit %d)", len(msg.data), msg.subject, ceiling
            )
            await _reply(
                msg,
                Reply(
                    "error",
                    message=f"payload_too_large: a report of {len(msg.data)} bytes is over the limit of {ceiling}",
                ),
            )
            return
        try:
            report = REPORT_DECODER.decode(msg.data)
        except Exception as exc:
            await _reply(msg, Reply("error", message=f"undecodable report: {exc}"))
            return
        sender = subject_worker(msg.subject)
        if sender is not None and sender != report.worker_id:
            self.fenced_total.inc()
            log.warning(
                "fenced %s naming worker %s sent by worker %s",
                type(report).__name__,
                report.worker_id,
                sender,
            )
            await _reply(
                msg, Reply("fenced", message=f"worker {sender} cannot report as {report.worker_id}")
            )
            return
        try:
            reply = await self._handle(report)
        except Held as exc:
            reply = Reply("ok", decision="hold", message=str(exc))
        except Fenced as exc:
            self.fenced_total.inc()
            log.warning(
                "fenced %s from %s: %s", type(report).__name__, report.worker_id, exc.message
            )
            reply = Reply("fenced", message=exc.message)
        except ApomeshError as exc:
            reply = Reply("error", message=exc.message)
        except Exception as exc:
            log.exception("report %s failed", type(report).__name__)
            reply = Reply("error", message=f"{type(exc).__name__}: {exc}")
        await _reply(msg, reply)

    async def _handle(self, report: Report) -> Reply:
        runtime = self.sessions.get(report.session_id)
        slot = runtime.slots.get(report.agent) if runtime else None
        if (
            runtime is None
            or slot is None
            or slot.epoch != report.epoch
            or slot.worker_id != report.worker_id
        ):
            if (
                isinstance(report, Done)
                and runtime is not None
                and runtime.state.agents.get(report.agent) is not None
            ):
                agent = runtime.state.agents[report.agent]
                if agent.epoch == report.epoch and agent.terminal:
                    return Reply("ok")  # a retried Done whose first copy was taken
            self.fenced_total.inc()
            log.warning(
                "fenced %s from %s for %s/%s epoch %s (current %s)",
                type(report).__name__,
                report.worker_id,
                report.session_id,
                report.agent,
                report.epoch,
                slot.epoch if slot else None,
            )
            return Reply("fenced", message=f"epoch {report.epoch} of {report.agent} is not current")
        worker = self.workers.get(report.worker_id)
        if worker is not None:
            worker.last_seen = max(worker.last_seen, time.monotonic() - self.interval)
        async with slot.lock:
            if (
                self.sessions.get(report.session_id) is not runtime
                or runtime.slots.get(report.agent) is not slot
            ):
                self.fenced_total.inc()
                log.warning(
                    "fenced %s from %s for %s/%s: its dispatch ended while it waited",
                    type(report).__name__,
                    report.worker_id,
                    report.session_id,
                    report.agent,
                )
                return Reply(
                    "fenced", message=f"epoch {report.epoch} of {report.agent} is not current"
                )
            return await self._dispatch_report(runtime, slot, report)

    async def _dispatch_report(self, runtime: SessionRuntime, slot: Any, report: Report) -> Reply:
        if isinstance(report, NodeReport):
            return await self._on_node(runtime, slot, report)
        if isinstance(report, JournalBegin):
            return await self._on_journal_begin(runtime, slot, report)
        if isinstance(report, JournalFinish):
            return await self._on_journal_finish(runtime, report)
        if isinstance(report, HitlAsk):
            return await self._on_hitl(runtime, report)
        if isinstance(report, JobStart):
            return await self._on_job(runtime, report)
        assert isinstance(report, Done)
        if not slot.future.done():
            slot.future.set_result(report)
        return Reply("ok")

    async def _on_node(self, runtime: SessionRuntime, slot: Any, report: NodeReport) -> Reply:
        from apomesh.core.events import AgentLifecycle, AgentSnapshotted

        agent = runtime.state.agents[report.agent]
        node = (report.step, report.source, report.reset)
        if node in slot.nodes:
            return Reply("ok")  # a retry of a node already stored
        size = len(ENCODER.encode(report))
        if size > self.config.limits.max_snapshot_bytes:
            return Reply(
                "error",
                message=f"snapshot of {size} bytes is over the limit of {self.config.limits.max_snapshot_bytes}",
            )
        agent_key = f"{runtime.session_id}/{report.agent}"
        recorded: list[ToolCallRecorded] = []
        for call in report.results:
            entry = runtime.state.journal.get((report.agent, call.key))
            if entry is None:
                return Reply("error", message="a result with no intent")
            if entry.outcome not in ("ok", "error"):
                recorded.append(
                    ToolCallRecorded(report.agent, call.key, call.tool, call.outcome, call.result)
                )
        snapshot = self.snapshots.write(
            agent_key, agent.config, report, after_id=agent.snapshot_id or 0
        )
        if recorded:
            # The node's results and its snapshot bytes do not depend on each other: log the one
            # while LMDB takes the other. The pointer waits for the bytes.
            (snapshot_id, written), _ = await asyncio.gather(snapshot, runtime.append(*recorded))
        else:
            snapshot_id, written = await snapshot
        events: list[Any] = []
        if not slot.running_logged:
            slot.running_logged = True
            events.append(AgentLifecycle(report.agent, "running", worker=report.worker_id))
        events.append(
            AgentSnapshotted(
                report.agent,
                snapshot_id=snapshot_id,
                source=report.source,
                step=report.step,
                size=written,
            )
        )

        async def copy_results() -> None:
            # LMDB's journal copy of a result follows the log's (so it goes with the pointer) and
            # replaces the copy of its intent (so it waits for that one).
            await self._journal_copies_written(agent_key)
            for r in recorded:
                record = {"tool": r.tool, "outcome": r.outcome, "result": r.result}
                await self.store.put_journal(agent_key, r.key, msgspec.msgpack.encode(record))

        await asyncio.gather(runtime.append(*events), copy_results())
        slot.nodes.add(node)
        self.snapshot_bytes.inc(written)
        return Reply("ok")

    async def _on_journal_begin(
        self, runtime: SessionRuntime, slot: Any, report: JournalBegin
    ) -> Reply:
        entry = runtime.state.journal.get((report.agent, report.key))
        agent_key = f"{runtime.session_id}/{report.agent}"
        if entry is not None and entry.outcome in ("ok", "error"):
            self.metrics.journal_hits.inc()
            return Reply("ok", decision="done", result=entry.result or "", outcome=entry.outcome)
        if entry is not None and report.key in slot.intents:
            return Reply("ok", decision="run")  # the same dispatch asking again after a lost reply
        if entry is not None:
            # An intent with no result from an earlier dispatch: the outcome is unknown.
            if report.on_unknown == "rerun" and report.idempotent:
                await runtime.append(
                    ToolCallIntent(
                        report.agent, report.key, report.tool, report.args, idempotent=True
                    )
                )
                slot.intents.add(report.key)
                return Reply("ok", decision="run")
            if (
                entry.outcome == "unknown"
                and report.on_unknown == "hold"
                and runtime.state.operator_actions
            ):
                return Reply(
                    "ok",
                    decision="failed",
                    message="the operator resumed past this unknown outcome",
                )
            if report.on_unknown == "hold" and not runtime.state.operator_actions:
                if entry.outcome is None:
                    await runtime.append(
                        ToolCallRecorded(
                            report.agent,
                            report.key,
                            report.tool,
                            "unknown",
                            "outcome unknown: held for an operator",
                        )
                    )
                return Reply("ok", decision="hold", message=f"outcome of {report.tool} unknown")
            if entry.outcome is None:
                await runtime.append(
                    ToolCallRecorded(
                        report.agent,
                        report.key,
                        report.tool,
                        "unknown",
                        "outcome unknown after a crash; not re-run",
                    )
                )
            return Reply(
                "ok",
                decision="failed",
                message="a crash interrupted this call and it is not idempotent, so it was not run again",
            )
        size = len(msgspec.json.encode(report.args))
        if size > self.config.limits.max_tool_args_bytes:
            return Reply(
                "error",
                message=f"tool arguments of {size} bytes are over the limit of {self.config.limits.max_tool_args_bytes}",
            )
        await runtime.append(
            ToolCallIntent(
                report.agent, report.key, report.tool, report.args, idempotent=report.idempotent
            )
        )
        slot.intents.add(report.key)
        self._copy_to_journal(agent_key, report.key, {"tool": report.tool, "args": report.args})
        return Reply("ok", decision="run")

    def _copy_to_journal(self, agent_key: str, call_key: str, record: dict[str, Any]) -> None:
        """Write LMDB's copy of a journal entry the log already holds. The effect does not wait
        for it (the log is what makes the intent durable; nothing decides from the copy), the
        agent's next node report does, so the copy is on disk by the node boundary."""
        task = self._spawn(
            self.store.put_journal(agent_key, call_key, msgspec.msgpack.encode(record))
        )
        pending = self._journal_copies.setdefault(agent_key, set())
        pending.add(task)

        def written(done: asyncio.Task[Any]) -> None:
            pending.discard(done)
            if not pending and self._journal_copies.get(agent_key) is pending:
                del self._journal_copies[agent_key]
            if not done.cancelled() and done.exception() is not None:
                log.error(
                    "journal copy of %s %s not written: %s",
                    agent_key,
                    call_key[:12],
                    done.exception(),
                )

        task.add_done_callback(written)

    async def _journal_copies_written(self, agent_key: str) -> None:
        pending = self._journal_copies.get(agent_key)
        if pending:
            await asyncio.wait(list(pending))

    async def _on_journal_finish(self, runtime: SessionRuntime, report: JournalFinish) -> Reply:
        entry = runtime.state.journal.get((report.agent, report.key))
        if entry is None:
            return Reply("error", message="a result with no intent")
        if entry.outcome in ("ok", "error"):
            return Reply("ok")
        await runtime.append(
            ToolCallRecorded(report.agent, report.key, report.tool, report.outcome, report.result)
        )
        await self._journal_copies_written(f"{runtime.session_id}/{report.agent}")
        await self.store.put_journal(
            f"{runtime.session_id}/{report.agent}",
            report.key,
            msgspec.msgpack.encode(
                {"tool": report.tool, "outcome": report.outcome, "result": report.result}
            ),
        )
        return Reply("ok")

    async def _on_hitl(self, runtime: SessionRuntime, report: HitlAsk) -> Reply:
        state = runtime.state
        if report.pause_id in state.hitl_answers:
            return Reply("ok", decision="answered", result=state.hitl_answers[report.pause_id])
        if report.pause_id not in state.hitl_pending:
            await runtime.append(HitlPaused(report.agent, report.pause_id, report.question))
        return Reply("ok", decision="paused")

    async def _on_job(self, runtime: SessionRuntime, report: JobStart) -> Reply:
        state = runtime.state
        done = state.jobs_done.get(report.job_id)
        if done is not None:
            return Reply(
                "ok", decision="done", result=done.result if done.ok else f"error: {done.result}"
            )
        if report.job_id not in state.jobs_in_flight:
            if report.tool not in self.plugins.tools():
                return Reply(
                    "error", message=f"no tool {report.tool!r} to run as a job on the daemon"
                )
            await runtime.append(
                AsyncJobStarted(report.agent, report.job_id, report.tool, report.args)
            )
            self.start_job(runtime, state.jobs_in_flight[report.job_id])
        return Reply("ok", decision="waiting")

    def start_job(self, runtime: SessionRuntime, job: AsyncJobStarted) -> None:
        """Run an async job on the daemon; its completion is appended and wakes the agent."""
        from apomesh.runtime.agent_loop import LoopContext

        async def run_job() -> None:
            tool = self.plugins.tools()[job.tool]
            config = runtime.state.agents[job.agent].current_config
            assert config is not None  # every agent is born with its config
            ctx = LoopContext(
                Run(runtime.session_id, job.agent, 0, config, "job", ""),
                worker_id="daemon",
                workspace_root=self.workspace,
                send=_no_send,
            )
            try:
                result, ok = await tool.run(ctx, job.args), True
            except Exception as exc:
                result, ok = f"{type(exc).__name__}: {exc}", False
            if not runtime.state.terminal:
                await runtime.append(AsyncJobFinished(job.agent, job.job_id, ok, result))

        self._spawn(run_job())

    # --- leases --------------------------------------------------------------------------------------

    async def _lease_renewal_forever(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            for session_id in list(self.sessions):
                with contextlib.suppress(Exception):
                    await self.kv.leases.renew(session_id, self.daemon_id)

    # --- metrics -------------------------------------------------------------------------------------

    def metrics_appended(self, count: int, seconds: float, kinds: list[str]) -> None:
        for kind in kinds:
            self.metrics.events_appended.labels(kind).inc()
        self.metrics.append_seconds.observe(seconds)


async def _no_send(report: Report) -> Reply:
    raise ApomeshError("an async job cannot report to the daemon")


async def _reply(msg: Msg, payload: Any) -> None:
    if msg.reply:
        with contextlib.suppress(Exception):
            await msg.respond(ENCODER.encode(payload))
