"""One live session on the daemon: its single writer, its coordinator loop and the driving of its
agents onto workers.

``SessionRuntime`` is the one writer of its session. Every change (a worker's node report, a
journal intent or result, a HITL pause or answer, a job's start or finish, an operator action, a
lifecycle step) goes through ``decide``: under the writer's one lock the change is decided against
the folded state, the candidate events are checked by folding them into a trial copy of the state
(``core.state.check``), and only then appended to the log and applied. A duplicate or stale command
is refused with ``CommandRefused`` and nothing is written. When the log refuses an append because
another writer got there first (``AppendConflict``), this daemon stops driving the session at once
(``on_end`` with ``Ending("conflict")``): its lease is given back and the session is read from the
log from then on.

The runtime is built with narrow collaborators (``SessionDeps``: the event log, the worker pool,
the snapshot store, the plugin host, an ``on_end`` callback, a spawn callback, its limits and
metrics); it never sees the daemon. The coordinator loop (a coordination kind) runs against it as
its ``CoordinatorContext``, replayed from the log after any recovery: each ``ask_root`` is placed in
the loop (the checkpoint the loop is at, the n-th ask since; logged on the root's ``dispatched``)
and gets a logged answer back only at its own place; a batch's children that ended are its results
(a failed child is never born again); a replay asking for other work than the log holds raises
``Nondeterminism``. Each agent run is driven by ``drive_agent``: dispatch to a worker with a
new fencing epoch, wait for the outcome, and when the worker is lost append ``AgentResuming`` and
re-dispatch under the same ref. Agents are composed from the session's effective shape: after an
operator moved the session to another agent version, new children are born with the new role
configs and an agent dispatched again is moved to its role's new config on its ``dispatched``
event. At a graceful shutdown ``drain`` stops the session at a node boundary: nothing more is
dispatched or started, each running dispatch ends after its next stored node, and the coordinator
logs ``SessionSuspended`` when no side effect is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.core import decisions, envelope
from apomesh.core.definition import AgentConfig
from apomesh.core.errors import (
    ApomeshError,
    AppendConflict,
    CommandRefused,
    DefinitionError,
    Fenced,
    FoldError,
    LogUnavailable,
    Nondeterminism,
    NotFound,
    PayloadTooLarge,
    StoreUnavailable,
)
from apomesh.core.events import (
    TURN_SOURCE,
    AgentLifecycle,
    AgentResumed,
    AgentResuming,
    AgentSnapshotted,
    AsyncJobFinished,
    AsyncJobStarted,
    CoordinatorCheckpoint,
    Event,
    HitlAnswered,
    HitlPaused,
    ModelRetrying,
    OperatorAction,
    SessionEnded,
    SessionRecovered,
    SessionShape,
    SessionSuspended,
    ToolCallIntent,
    ToolCallRecorded,
    event_name,
)
from apomesh.core.journal import idempotency_key
from apomesh.core.ports import EventLog
from apomesh.core.state import AgentView, SessionState, apply, check
from apomesh.core.state_codec import FoldCheckpoint, make_checkpoint, shape_key
from apomesh.plugins.api import (
    BATCH_DONE_EARLY,
    ROOT_PURPOSES,
    Checkpoint,
    ChildResult,
    DoneWhen,
    RootAnswer,
)
from apomesh.plugins.manager import PluginHost
from apomesh.runtime import tracing
from apomesh.runtime.config import LimitsConfig
from apomesh.runtime.fold_checkpoints import CHECKPOINT_EVERY, FoldCheckpoints, KnowsSequences
from apomesh.runtime.metrics import DaemonMetrics
from apomesh.runtime.pinning import worker_pins
from apomesh.runtime.progress import Waiting
from apomesh.runtime.protocol import (
    ENCODER,
    MODEL_CALL_FAILED,
    Done,
    HitlAsk,
    JobStart,
    JournalBegin,
    JournalFinish,
    MemoryFetch,
    ModelCallFailed,
    NodeReport,
    Reply,
    Report,
    Run,
    TurnReport,
)
from apomesh.runtime.snapshots import SnapshotStore, StagedSnapshot
from apomesh.runtime.workers import Dispatch, WorkerLost, WorkerPool

log = logging.getLogger("apomesh.session")

T = TypeVar("T")


class AgentFailed(Exception):
    """An agent the coordinator needed ended without an answer."""


class Held(Exception):
    """The session waits for an operator (an unknown side-effect outcome under a ``hold`` policy)."""


class Drained(Exception):
    """The daemon is draining (a graceful shutdown): this agent stopped at a node boundary, or
    was not dispatched, and the session stops here to be resumed by the next daemon."""


class Ending(msgspec.Struct, frozen=True):
    """Why a runtime stops driving its session: it ``finished`` (its log is terminal), it is
    ``stranded`` (held for an operator: ``reason``, ``category``), its append met a
    ``conflict`` (another writer appended to its log), or NATS did not answer what its
    coordinator needed (``unavailable``: the log or the replicated store out of reach for longer
    than a call waits; the session is driven again from its log once NATS answers)."""

    kind: Literal["finished", "stranded", "conflict", "unavailable"]
    reason: str = ""
    category: str = ""


class SessionDeps(msgspec.Struct, frozen=True, dict=True):
    """What a session's writer is built with; the same for every session of one daemon."""

    log: EventLog
    workers: WorkerPool
    snapshots: SnapshotStore
    store: AsyncStore
    plugins: PluginHost
    limits: LimitsConfig
    metrics: DaemonMetrics
    incarnation: str
    workspace: Path
    on_end: Callable[[SessionRuntime, Ending], Coroutine[Any, Any, None]]
    """Called once when the runtime stops driving its session (the registry's bookkeeping)."""
    spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]
    """Runs a background task the daemon cancels at shutdown."""
    closing: Callable[[], bool]
    """True once the daemon shuts down: nothing waits for the log any more."""
    checkpoints: FoldCheckpoints | None = None
    """Where the writer stores its session's folded state now and then (None: it does not)."""
    checkpoint_every: int = CHECKPOINT_EVERY
    """Events appended between two of those checkpoints."""
    node_commit_delay: float = 0.05
    """Seconds a node's snapshot waits for its agent's next store write (``DeferredNode``)."""
    waiting_for_log: Waiting = msgspec.field(default_factory=Waiting)
    """The sessions whose step waits for the log now (NATS not answering), and their one
    warning every few seconds."""

    @functools.cached_property
    def checkpoint_sources(self) -> frozenset[str]:
        """The checkpoint sources a node may name (the plugin host's registry never changes)."""
        return frozenset(self.plugins.checkpoint_sources())

    @functools.cached_property
    def sequences(self) -> KnowsSequences | None:
        """The log, when it tells the stream sequence of an event (asked once per daemon: an
        ``isinstance`` against a protocol walks its members)."""
        return self.log if isinstance(self.log, KnowsSequences) else None


class DispatchSlot(msgspec.Struct):
    """The one in-flight dispatch of an agent: the only epoch and worker it accepts reports from."""

    agent: str
    epoch: int
    worker_id: str
    dispatch: Dispatch
    intents: set[str] = msgspec.field(default_factory=set)
    probes: set[str] = msgspec.field(default_factory=set)
    """Keys this dispatch was asked to probe (an intent from an earlier one, with no result)."""
    running_logged: bool = False
    nodes: set[tuple[int, str, bool]] = msgspec.field(default_factory=set)
    """(step, source, reset) of every node report stored for this dispatch (retries are no-ops)."""
    lock: asyncio.Lock = msgspec.field(default_factory=asyncio.Lock)
    """Serialises this dispatch's reports, so a retry never races its first copy."""
    memory: bytes = b""
    """The encoded working memory, when it was too large to travel with the dispatch: the worker
    fetches it in pages of ``page_bytes``."""
    page_bytes: int = 0
    deferred: DeferredNode | None = None
    """The last node reported, its snapshot not stored yet (see ``DeferredNode``)."""

    @property
    def future(self) -> asyncio.Future[Any]:
        return self.dispatch.future


class DeferredNode(msgspec.Struct):
    """A node whose results are on the log and whose snapshot waits for the agent's next store
    write (``SessionRuntime._store``): the next turn's record, the next node, the dispatch's
    ``Done`` or its end. So a step commits to LMDB once (the node's snapshot travels with the
    next turn's record) and its pointer joins the next turn's append. Until then the agent's
    logged snapshot is its turn's: a daemon that dies first replays the node from that turn
    (its journaled calls are served from the log), as when it died before the node's report.
    A node waits at most ``SessionDeps.node_commit_delay`` (a model slower than that, a worker
    gone quiet): then it is stored and logged alone, so what the session shows and what a crash
    replays lag by little."""

    staged: StagedSnapshot
    pointer: AgentSnapshotted
    stored: bool = False
    """Whether its bytes are committed (only its pointer is left to append)."""
    timer: asyncio.TimerHandle | None = None
    """Stores it alone once ``node_commit_delay`` has passed with no next write."""


Rule = Callable[[SessionState], tuple[Sequence[Event], T]]
"""A decision against the folded state: the events to append (maybe none) and the answer."""


class SessionRuntime:
    """A session the daemon drives. Implements ``CoordinatorContext`` for the coordination kind."""

    # Slots, not a dict per instance: a boot scan adopts tens of thousands at once.
    __slots__ = (
        "_asks",
        "_changed",
        "_checkpointed",
        "_checkpointing",
        "_cursor",
        "_drivers",
        "_id_counter",
        "_id_prefix",
        "_jobs",
        "_last_event_id",
        "_last_messages",
        "_last_seq",
        "_opened",
        "_recovering",
        "_replaying",
        "_saved",
        "_sequences",
        "_unwritten_copies",
        "_writer",
        "conflict",
        "deps",
        "draining",
        "fresh_children",
        "held_reason",
        "recovered",
        "session_id",
        "slots",
        "state",
        "stopped",
        "task",
    )

    def __init__(
        self, deps: SessionDeps, state: SessionState, *, fresh_children: bool = False
    ) -> None:
        self.deps = deps
        self.state = state
        self.session_id = state.session_id
        self.fresh_children = fresh_children
        self.slots: dict[str, DispatchSlot] = {}
        self._changed: asyncio.Condition | None = None
        """Made by the first ``wait_for`` (most sessions never have a waiter: a boot scan
        adopts tens of thousands, and each step would otherwise notify nobody)."""
        self._writer = asyncio.Lock()
        self.task: asyncio.Task[None] | None = None
        self._opened: asyncio.Event | None = None
        self.held_reason: str | None = None
        self.conflict: AppendConflict | None = None
        """Set when another writer appended to this session's log: nothing more is written here."""
        self.stopped = False
        """Set by ``retire``, or when an append is given up at shutdown (it may be stored):
        nothing more is appended here (an append waiting for the log gives up), so the next
        writer of the session folds a log this one no longer moves."""
        self._recovering = fresh_children or bool(state.agents)
        # The coordinator loop's position: the checkpoint it is at (its log index, -1 before the
        # first) and how many times it asked the root since. A recovered loop starts at the
        # latest checkpoint; re-saving a logged one (a kind walking its loop from the start)
        # moves it back there while the loop replays (``_replaying``).
        self._cursor = state.checkpoint_index if state.checkpoint_index is not None else -1
        self._asks = 0
        self._replaying = bool(state.checkpoints)
        self._saved = False
        self.recovered: Literal["auto", "operator"] | None = None
        self.draining = False
        """Set by ``drain`` (a graceful shutdown): nothing more is dispatched, every running
        dispatch stops at its next node boundary, and once ``SessionSuspended`` is logged
        nothing more is appended here."""
        self._unwritten_copies: dict[str, dict[str, bytes]] = {}
        """LMDB copies of journal intents on the log, by agent key and call key, stored with the
        agent's next store write (``_copy_to_journal``)."""
        self._jobs: dict[tuple[str, str], asyncio.Task[Any]] = {}
        """The async jobs this writer runs, by (agent, job id)."""
        self._drivers: set[asyncio.Task[Any]] = set()
        """The tasks driving an agent (``drive_agent``), stopped when the session is held."""
        self._id_prefix = os.urandom(8).hex()
        self._id_counter = itertools.count()
        self._last_event_id: str | None = None
        """The event id of the envelope at ``state.last_index``, once this writer appended."""
        self._last_seq: int | None = None
        """Its stream sequence, when the log knows it."""
        self._last_messages: int | None = None
        """How many messages of the session the log holds up to it, when the log knows."""
        self._checkpointed = -1
        """The index of the last fold checkpoint this writer stored (-1: none yet)."""
        self._checkpointing: asyncio.Task[None] | None = None
        self._sequences = deps.sequences
        """The log, when it tells the stream sequence of an event (asked at every append)."""

    @property
    def opened(self) -> asyncio.Event:
        """Set once the started writer has logged its opening (``SessionRecovered``, a missing
        root's birth) or stopped trying: what a boot scan starting sessions in waves waits for.
        Made when first asked for (by the wave that starts the session, or by the writer)."""
        if self._opened is None:
            self._opened = asyncio.Event()
        return self._opened

    # --- the single writer -----------------------------------------------------------------------

    def _event_id(self) -> str:
        """A new event id: 32 hex digits, this writer's random prefix and a counter (unique like a
        uuid4, without a system call per event)."""
        return f"{self._id_prefix}{next(self._id_counter):016x}"

    async def decide(self, rule: Rule[T]) -> T:
        """Decide a change against the folded state under the writer's lock, check its events with
        the pure fold, append them, apply them; answers the rule's answer. A rule refuses a
        duplicate or stale command by raising (``CommandRefused``): nothing is written then."""
        async with self._writer:
            if self.conflict is not None:
                raise Fenced(f"session {self.session_id} is driven by another writer")
            if self.stopped:
                raise Fenced(f"session {self.session_id}: this writer was stopped")
            if self.state.terminal:
                # A report or request that raced the session's end: refused, never appended. A
                # command the ended state refuses by itself (a pause answered twice) is refused
                # as such, as it is once this writer is gone.
                refused = _refusal(rule, self.state)
                if refused is not None:
                    raise refused
                raise Fenced(f"session {self.session_id} has ended; nothing more is appended")
            if self.draining and self.state.suspended_index == self.state.last_index:
                raise Fenced(f"session {self.session_id} is suspended for the next daemon")
            events, answer = rule(self.state)
            if not events:
                return answer
            now = time.time()
            first = self.state.last_index + 1
            envs = [
                envelope.make(self.session_id, first + i, now, self._event_id(), ev)
                for i, ev in enumerate(events)
            ]
            try:
                check(self.state, envs)
            except FoldError as exc:
                raise CommandRefused(
                    f"session {self.session_id} refuses {', '.join(map(event_name, events))}: "
                    f"{exc.message}"
                ) from None
            try:
                await self._commit(envs, events)
            except asyncio.CancelledError:
                # A caller cancelled mid-append (a batch done early), before anything was
                # applied: the append may have landed. The same envelopes are sent again (the log
                # settles a resend: written once) and applied, so the step still lands whole or
                # not at all and the state never drifts from the log; then the cancellation
                # goes on. The lock is held until that resend is done, however often the caller
                # is cancelled meanwhile: a next decision made before it would put other events
                # at the same indexes. (No task per step: the step's own task does the common
                # case.)
                resend = asyncio.ensure_future(self._commit(envs, events))
                while not resend.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([resend])
                with contextlib.suppress(BaseException):
                    resend.result()
                raise
        await self.poke()
        return answer

    async def _commit(self, envs: list[envelope.Envelope], events: Sequence[Event]) -> None:
        started = time.perf_counter()
        await self._append_durably(envs)
        seconds = time.perf_counter() - started
        self.deps.metrics.count_appended(events)
        self.deps.metrics.append_seconds.observe(seconds)
        for env in envs:
            apply(self.state, env)
        # Noted with the state in one synchronous stretch: a checkpoint pairs them.
        self._last_event_id = envs[-1].event_id
        end = (
            self._sequences.known_end(self.session_id, envs[-1].index)
            if self._sequences is not None
            else None
        )
        self._last_seq, self._last_messages = end if end is not None else (None, None)
        self._after_commit()

    # --- fold checkpoints (runtime.fold_checkpoints) ----------------------------------------------

    def _after_commit(self) -> None:
        """Note the session as changed for the next ``keep_current`` write, and start storing a
        fold checkpoint at once when ``checkpoint_every`` events were appended since the last
        (one at a time, as a task of its own: the step's caller does not wait for it); drop the
        session's checkpoint once it has ended."""
        checkpoints, every = self.deps.checkpoints, self.deps.checkpoint_every
        if checkpoints is None:
            return
        if self.state.terminal:
            checkpoints.forget(self.session_id)
            state = self.state
            # One may be stored: by this writer, or by one before it (a resumed session, or a
            # long one). One left behind is harmless: the session is skipped as completed, and
            # retention removes it with its other records.
            if (
                self._checkpointed >= 0
                or state.recoveries
                or state.resumes
                or (state.last_index >= every)
            ):
                self.deps.spawn(self._drop_checkpoint(checkpoints))
            return
        checkpoints.changed(self)
        if self._checkpointing is not None and not self._checkpointing.done():
            return
        if self.state.last_index - self._checkpointed >= every:
            self._checkpointing = self.deps.spawn(self._write_checkpoint(checkpoints))

    def current_checkpoint(self) -> tuple[FoldCheckpoint, SessionShape | None] | None:
        """The fold checkpoint of the state this writer holds, and the shape it leaves out (see
        ``runtime.fold_checkpoints``); None for an ended or refused session, or before its first
        append here."""
        if self.state.terminal or self.conflict is not None or self._last_event_id is None:
            return None
        if self.state.last_index <= self._checkpointed:
            return None  # stored already
        bootstrap = self.state.bootstrap
        shape = None if bootstrap is None else bootstrap.shape
        checkpoints = self.deps.checkpoints
        key = None
        if shape is not None:
            key = shape_key(shape) if checkpoints is None else checkpoints.shape_key(shape)
        # Every applied event was acknowledged by the log first, so the state is durable there.
        checkpoint = make_checkpoint(
            self.state,
            self._last_event_id,
            self._last_seq,
            messages=self._last_messages,
            log_id=None if self._sequences is None else self._sequences.log_id,
            shape=key,
        )
        self._checkpointed = checkpoint.index
        return checkpoint, shape

    def checkpoint_lost(self) -> None:
        """The last checkpoint made was not stored: the next one is made whatever the index."""
        self._checkpointed = -1

    async def _write_checkpoint(self, checkpoints: FoldCheckpoints) -> None:
        await asyncio.sleep(0)  # the step that crossed the threshold is answered first
        made = self.current_checkpoint()
        if made is None:
            return
        try:
            await checkpoints.write(*made)
        except Exception as exc:  # only an accelerator: the next one is tried later
            self.checkpoint_lost()
            checkpoints.changed(self)
            log.warning("session %s: fold checkpoint not stored: %s", self.session_id, exc)

    async def _drop_checkpoint(self, checkpoints: FoldCheckpoints) -> None:
        writing = self._checkpointing
        if writing is not None:
            await asyncio.wait([writing])  # its write lands first, so the delete is the last word
        try:
            await checkpoints.delete(self.session_id)
        except Exception as exc:
            log.warning("session %s: fold checkpoint not removed: %s", self.session_id, exc)

    async def append(self, *events: Event) -> int:
        """Append a step's events unconditionally decided (checked by the fold all the same);
        answers the index of the last one."""
        await self.decide(lambda state: (events, None))
        return self.state.last_index

    async def _append_durably(self, envs: list[envelope.Envelope]) -> None:
        # While NATS is out of reach (a server restart) the step waits and is sent again, the
        # same envelopes with the same ids: the log settles a resend, so nothing is written twice.
        delay = 0.05
        waiting = self.deps.waiting_for_log
        counted = False
        try:
            while True:
                try:
                    await self.deps.log.append(self.session_id, envs)
                    return
                except LogUnavailable as exc:
                    if self.deps.closing() or self.stopped:
                        # Given up with the append perhaps stored: this writer no longer knows
                        # where its log ends, so it appends nothing more (the next one folds it).
                        self.stopped = True
                        raise
                    if not counted:
                        counted = True
                        waiting.enter()
                    if waiting.due():
                        log.warning(
                            "session %s waits for the log%s: %s",
                            self.session_id,
                            waiting.others(counted),
                            exc,
                        )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                except AppendConflict as exc:
                    self._lost_to_another_writer(exc)
                    raise
        finally:
            if counted:
                waiting.leave()

    def _lost_to_another_writer(self, exc: AppendConflict) -> None:
        """Another writer appended to this session's log: stop driving it here, at once."""
        if self.conflict is None:
            self.deps.metrics.append_conflicts.inc()
        self.superseded(exc, f"another writer appended to its log ({exc.message})")

    def superseded(self, exc: AppendConflict, why: str) -> None:
        """Another owner writes this session now (its appends conflict, or it holds the lease):
        nothing more is written here, and ``on_end`` hands the session back to the log."""
        if self.conflict is not None:
            return
        self.conflict = exc
        log.error(
            "session %s: %s; this daemon stops driving it and gives back its lease; it is read "
            "from the log from now on",
            self.session_id,
            why,
        )
        self.deps.spawn(self.deps.on_end(self, Ending("conflict", reason=why)))

    async def wait_for(self, predicate: Any, timeout: float | None = None) -> None:
        if self._changed is None:
            self._changed = asyncio.Condition()
        changed = self._changed
        async with changed, asyncio.timeout(timeout):
            await changed.wait_for(predicate)

    async def poke(self) -> None:
        """Wake whoever waits in ``wait_for`` to look at the state again."""
        changed = self._changed
        if changed is not None:
            async with changed:
                changed.notify_all()

    # --- commands from operators -----------------------------------------------------------------

    async def answer_hitl(self, pause_id: str, answer: str, *, by: str) -> None:
        """Answer an open pause; a second answer, or one to a closed pause, is refused."""

        def rule(state: SessionState) -> tuple[list[Event], None]:
            if pause_id in state.hitl_answers:
                raise CommandRefused(f"pause {pause_id} is not open: it was already answered")
            if pause_id not in state.hitl_pending:
                raise NotFound(f"open pause {pause_id} in session {self.session_id}")
            return [HitlAnswered(pause_id=pause_id, answer=answer, by=by)], None

        await self.decide(rule)

    # --- reports from workers (routed here by the control plane) ---------------------------------

    async def handle_report(self, report: Report, size: int) -> Reply:
        """Fence a worker's report (``size`` bytes encoded, which the snapshot limit is checked
        against) against the agent's current dispatch, then decide it."""
        slot = self.slots.get(report.agent)
        if slot is None or slot.epoch != report.epoch or slot.worker_id != report.worker_id:
            agent = self.state.agents.get(report.agent)
            if (
                isinstance(report, Done)
                and agent is not None
                and agent.epoch == report.epoch
                and agent.terminal
            ):
                return Reply("ok")  # a retried Done whose first copy was taken
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
        self.deps.workers.heard_from(report.worker_id)
        async with slot.lock:
            if self.slots.get(report.agent) is not slot or self.conflict is not None:
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
            if self.draining and isinstance(report, JournalBegin | HitlAsk | JobStart):
                return self._stop_at_boundary(slot)  # nothing new starts while draining
            if isinstance(report, NodeReport):
                reply = await self._on_node(slot, report, size)
                if self.draining and reply.status == "ok" and _continues(report):
                    return self._stop_at_boundary(slot)
                return reply
            if isinstance(report, TurnReport):
                return await self._on_turn(slot, report, size)
            if isinstance(report, JournalBegin):
                return await self._on_journal_begin(slot, report)
            if isinstance(report, JournalFinish):
                return await self._on_journal_finish(slot, report)
            if isinstance(report, HitlAsk):
                return await self._on_hitl(report)
            if isinstance(report, JobStart):
                return await self._on_job(report)
            if isinstance(report, MemoryFetch):
                return self._on_memory(slot, report)
            if isinstance(report, ModelCallFailed):
                return await self._on_model_failed(report)
            assert isinstance(report, Done)
            await self._log_deferred_or_drop(slot)
            # The journal copies no snapshot of this dispatch will take now.
            await self._store(slot, f"{self.session_id}/{report.agent}")
            if not slot.future.done():
                slot.future.set_result(report)
            return Reply("ok")

    def _stop_at_boundary(self, slot: DispatchSlot) -> Reply:
        """While draining: end this dispatch here (the worker drops it when it reads the answer);
        the agent continues from its last stored node under the next daemon."""
        if not slot.future.done():
            slot.future.set_exception(Drained(f"{slot.agent} stopped at a node boundary"))
        return Reply("fenced", message="the daemon is shutting down; resumed at its next start")

    async def drain(self) -> None:
        """A graceful shutdown: dispatch nothing more, stop every running dispatch at its next
        node boundary; the coordinator then logs ``SessionSuspended`` (``_suspend``)."""
        self.draining = True
        await self.poke()

    async def _suspend(self) -> None:
        """Once every dispatch has stopped: mark the session suspended on its log for the next
        daemon, unless a side effect is in flight (an intent without its result: that one is an
        unknown outcome, and the session is recovered like a crashed one). A side-effecting job
        this writer is running is waited for too (within the registry's grace period): cut off,
        its outcome would be unknown; a read-only one simply runs again under the next daemon."""
        while self.slots or self._side_effecting_jobs():
            await asyncio.sleep(0.05)

        def rule(state: SessionState) -> tuple[list[Event], bool]:
            if any(e.outcome is None for e in state.journal.values()):
                return [], False
            if any(job.side_effect for job in state.jobs_in_flight.values()):
                return [], False
            suspended = SessionSuspended(incarnation=self.deps.incarnation)
            return [suspended], True

        if await self.decide(rule):
            # One line each at debug: a drain of thousands says how many in one line (registry).
            log.debug(
                "session %s suspended at a node boundary for the next daemon", self.session_id
            )
        else:
            log.warning(
                "session %s stopped with a side effect in flight; it is not marked suspended",
                self.session_id,
            )

    def _side_effecting_jobs(self) -> list[asyncio.Task[Any]]:
        """The running jobs of this writer whose tool declares a side effect."""
        in_flight = self.state.jobs_in_flight
        return [
            task
            for key, task in self._jobs.items()
            if not task.done() and key in in_flight and in_flight[key].side_effect
        ]

    def _node_refusal(self, report: NodeReport, size: int) -> Reply | None:
        """Why a node report (``size`` bytes encoded) is refused, if it is."""
        sources = self.deps.checkpoint_sources
        if report.source == TURN_SOURCE:
            # Only a TurnReport records a turn: a node pointer of that source would be replayed.
            return Reply("error", message=f"a node report cannot carry source {TURN_SOURCE!r}")
        if report.source not in sources:
            # The closed set: the built-in sources and those plugins declare (never a HITL pause).
            known = ", ".join(sorted(sources))
            message = f"unknown snapshot source {report.source!r} (known: {known})"
            return Reply("error", message=message)
        limit = self.deps.limits.max_snapshot_bytes
        if size > limit:
            return Reply("error", message=f"snapshot of {size} bytes is over the limit of {limit}")
        if any((report.agent, call.key) not in self.state.journal for call in report.results):
            return Reply("error", message="a result with no intent")
        return None

    @staticmethod
    def _recorded(state: SessionState, report: NodeReport) -> list[ToolCallRecorded]:
        """The results a node report carries that the log does not hold yet."""
        return [
            ToolCallRecorded(report.agent, call.key, call.tool, call.outcome, call.result)
            for call in report.results
            if state.journal[(report.agent, call.key)].outcome not in ("ok", "error")
        ]

    def _node_taken(self, slot: DispatchSlot, report: NodeReport) -> None:
        """Bookkeeping once a node's results are logged."""
        slot.running_logged = True
        slot.nodes.add((report.step, report.source, report.reset))
        self._observe_answer(report)
        for timing in report.tool_timings:
            self.deps.metrics.observe_tool_call(timing.tool, timing.seconds, timing.outcome)

    async def _on_node(self, slot: DispatchSlot, report: NodeReport, size: int) -> Reply:
        if (report.step, report.source, report.reset) in slot.nodes:
            return Reply("ok")  # a retry of a node already stored
        refused = self._node_refusal(report, size)
        if refused is not None:
            return refused
        agent_key = f"{self.session_id}/{report.agent}"
        deferred = slot.deferred
        staged = await self._stage(slot, agent_key, report)
        # The node's results are logged now; its snapshot waits for the agent's next store
        # write (``DeferredNode``). A node before it that no turn stored (its calls were all
        # read-only) is stored now, its pointer logged with these results.
        delay = self.deps.node_commit_delay
        if delay > 0:
            before = await self._store(slot, agent_key) if deferred is not None else []
            after: list[Event] = []
        else:
            before = await self._store(slot, agent_key, staged)
            after = [self._pointer(report, staged)]
            self.deps.metrics.snapshot_bytes.inc(staged.written)

        def results(state: SessionState) -> tuple[list[Event], list[ToolCallRecorded]]:
            recorded = self._recorded(state, report)
            return [*before, *self._running(slot, report), *recorded, *after], recorded

        recorded = await self.decide(results)
        self._clear_deferred(slot)
        if delay > 0:
            waiting = DeferredNode(staged, self._pointer(report, staged))
            waiting.timer = asyncio.get_running_loop().call_later(
                delay, self._deferred_due, slot, waiting
            )
            slot.deferred = waiting
        self._copy_results(agent_key, recorded)
        self._node_taken(slot, report)
        return Reply("ok")

    async def _stage(
        self,
        slot: DispatchSlot,
        agent_key: str,
        report: NodeReport | TurnReport,
        on: StagedSnapshot | None = None,
    ) -> StagedSnapshot:
        """The report's snapshot, staged after ``on`` (a snapshot staged just before it) or else
        after the dispatch's deferred node (if any)."""
        agent = self.state.agents[report.agent]
        if on is None and slot.deferred is not None:
            on = slot.deferred.staged
        return await self.deps.snapshots.stage(
            agent_key, agent.config, report, after_id=agent.snapshot_id or 0, on=on
        )

    async def _store(
        self, slot: DispatchSlot, agent_key: str, *staged: StagedSnapshot
    ) -> list[Event]:
        """One LMDB commit of what the agent has waiting (its deferred node's snapshot and the
        journal copies kept since its last store write) with ``staged``, snapshots staged after
        it (a turn's, and the node before it that the turn's report carried). Answers the
        deferred node's pointer, for the caller to append first in its next append (and clear
        ``slot.deferred`` once that landed). A failed commit leaves both waiting, for the
        worker's retry."""
        deferred = slot.deferred
        batch = [deferred.staged] if deferred is not None and not deferred.stored else []
        batch.extend(staged)
        copies = self._journal_copies(agent_key)
        if batch or copies:
            try:
                await self.deps.snapshots.commit(batch, journal={agent_key: copies})
            except BaseException:
                self._keep_copies(agent_key, copies)
                raise
        if deferred is None:
            return []
        if not deferred.stored:
            deferred.stored = True
            self.deps.metrics.snapshot_bytes.inc(deferred.staged.written)
        return [deferred.pointer]

    @staticmethod
    def _clear_deferred(slot: DispatchSlot) -> None:
        """The deferred node is stored and logged (or dropped): forget it and its timer."""
        deferred, slot.deferred = slot.deferred, None
        if deferred is not None and deferred.timer is not None:
            deferred.timer.cancel()

    def _deferred_due(self, slot: DispatchSlot, deferred: DeferredNode) -> None:
        """``node_commit_delay`` passed with ``deferred`` still waiting: store and log it."""
        if slot.deferred is deferred and self.slots.get(slot.agent) is slot:
            self.deps.spawn(self._log_deferred_when_due(slot, deferred))

    async def _log_deferred_when_due(self, slot: DispatchSlot, deferred: DeferredNode) -> None:
        async with slot.lock:
            if slot.deferred is not deferred or self.slots.get(slot.agent) is not slot:
                return  # a report of the agent took it meanwhile
            try:
                await self._log_deferred(slot)
            except Exception as exc:  # it stays deferred: the agent's next write takes it
                log.warning(
                    "the node of %s/%s at step %d waits for its next write: %s",
                    self.session_id,
                    slot.agent,
                    deferred.pointer.step,
                    exc,
                )

    async def _log_deferred(self, slot: DispatchSlot) -> None:
        """Store and log the dispatch's deferred node, if any, on its own (the dispatch ended
        or is ending: no later report of it takes it). The caller holds ``slot.lock``."""
        if slot.deferred is None:
            return
        agent_key = f"{self.session_id}/{slot.agent}"
        await self.append(*await self._store(slot, agent_key))
        self._clear_deferred(slot)

    async def _log_deferred_or_drop(self, slot: DispatchSlot) -> None:
        """``_log_deferred`` for a dispatch that has ended, whatever happens: a node that cannot
        be stored or logged now is dropped, and the agent continues from the snapshot the log
        points to (the node replayed from its turn, its journaled calls served from the log).
        The caller holds ``slot.lock``."""
        try:
            await self._log_deferred(slot)
        except Exception as exc:
            log.warning(
                "the last node of %s/%s epoch %d is not stored (%s); its turn is replayed",
                self.session_id,
                slot.agent,
                slot.epoch,
                exc,
            )
        self._clear_deferred(slot)

    def _observe_answer(self, report: NodeReport | TurnReport) -> None:
        call = report.model_call
        if call is not None:
            self._observe_model_call(
                report.agent, call.seconds, call.prompt_tokens, call.completion_tokens, "ok"
            )

    @staticmethod
    def _running(slot: DispatchSlot, report: NodeReport | TurnReport) -> list[Event]:
        """The agent's ``running``, when this dispatch has not logged it yet."""
        if slot.running_logged:
            return []
        return [AgentLifecycle(report.agent, "running", worker=report.worker_id)]

    @staticmethod
    def _pointer(report: NodeReport | TurnReport, staged: StagedSnapshot) -> AgentSnapshotted:
        """The pointer that logs a stored snapshot."""
        call = report.model_call
        return AgentSnapshotted(
            report.agent,
            snapshot_id=staged.snapshot_id,
            source=report.source,
            step=report.step,
            size=staged.written,
            model_calls=1 if call is not None else 0,
            prompt_tokens=call.prompt_tokens if call is not None else 0,
            completion_tokens=call.completion_tokens if call is not None else 0,
        )

    def _observe_model_call(
        self, agent: str, seconds: float, prompt: int, completion: int, outcome: str
    ) -> None:
        config = self.state.agents[agent].current_config
        model = config.model if config is not None else None
        self.deps.metrics.observe_model_call(
            model.provider if model is not None else "",
            model.model if model is not None else "",
            seconds,
            prompt,
            completion,
            outcome,
        )

    async def _on_model_failed(self, report: ModelCallFailed) -> Reply:
        """A failed attempt of a model call: counted, and when it is tried again, logged
        (``ModelRetrying``) so the session shows what the agent waits for. A retried report of
        the same attempt logs nothing more."""
        retrying = self.state.agents[report.agent].retrying
        if retrying is not None and retrying.attempt == report.attempt:
            return Reply("ok")
        self._observe_model_call(report.agent, report.seconds, 0, 0, "error")
        if report.retry_in is not None:
            await self.append(
                ModelRetrying(
                    report.agent,
                    attempt=report.attempt,
                    delay=report.retry_in,
                    reason=report.reason,
                    status=report.status,
                )
            )
        return Reply("ok")

    def _on_memory(self, slot: DispatchSlot, report: MemoryFetch) -> Reply:
        """A page of the working memory this dispatch did not carry."""
        pages = -(-len(slot.memory) // slot.page_bytes) if slot.page_bytes else 0
        if not 0 <= report.page < pages:
            return Reply("error", message=f"this dispatch has no memory page {report.page}")
        start = report.page * slot.page_bytes
        return Reply("ok", data=slot.memory[start : start + slot.page_bytes])

    async def _on_turn(self, slot: DispatchSlot, report: TurnReport, size: int) -> Reply:
        """A model turn the agent is about to act on: its snapshot (the turn in the record, the
        messages before it in a segment) is stored and its pointer (source ``turn``) appended
        before the worker hears back, so a later dispatch replays the turn instead of asking the
        model again. The node before it, when the report carries it (``TurnReport.node``), is
        taken in the same decision: its results and pointer lead the turn's pointer, and both
        snapshots share one commit."""
        intent, node = report.intent, report.node
        for part in (intent, node):
            if part is not None and (part.worker_id, part.agent, part.epoch) != (
                report.worker_id,
                report.agent,
                report.epoch,
            ):
                return Reply("error", message="a turn's report carries another dispatch's part")
        key = (report.step, report.source, False)
        if key in slot.nodes:
            # A retry of a turn already stored (its reply was lost; its node was taken with it):
            # its intent is asked again.
            if intent is None:
                return Reply("ok")
            if self.draining:
                return self._stop_at_boundary(slot)
            return await self._on_journal_begin(slot, intent)
        limit = self.deps.limits.max_snapshot_bytes
        node_size = 0
        if node is not None and size > limit:
            node_size = len(ENCODER.encode(node))  # each snapshot is held to the limit alone
        if size - node_size > limit:
            message = f"snapshot of {size - node_size} bytes is over the limit of {limit}"
            return Reply("error", message=message)
        if node is not None:
            if node.step >= report.step:
                return Reply("error", message="a turn's report carries a later node")
            refused = self._node_refusal(node, node_size)
            if refused is not None:
                return refused
        agent_key = f"{self.session_id}/{report.agent}"
        node_staged = await self._stage(slot, agent_key, node) if node is not None else None
        staged = await self._stage(slot, agent_key, report, on=node_staged)
        # One commit: the node deferred before this turn, the node this report carries, and the
        # turn; their pointers (and the carried node's results) lead this append.
        before = await self._store(slot, agent_key, *filter(None, (node_staged, staged)))
        recorded: list[ToolCallRecorded] = []

        def leading(state: SessionState) -> list[Event]:
            events: list[Event] = [*before, *self._running(slot, report)]
            if node is not None and node_staged is not None:
                recorded[:] = self._recorded(state, node)
                events += [*recorded, self._pointer(node, node_staged)]
            return [*events, self._pointer(report, staged)]

        if intent is not None and not self.draining:
            # The turn's first intent is decided with its pointer, in one append.
            reply = await self._on_journal_begin(slot, intent, before=leading)
        else:
            await self.decide(lambda state: (leading(state), None))
            reply = Reply("ok")
        self._clear_deferred(slot)
        if node is not None and node_staged is not None:
            self._copy_results(agent_key, recorded)
            self._node_taken(slot, node)
            self.deps.metrics.snapshot_bytes.inc(node_staged.written)
        slot.running_logged = True
        slot.nodes.add(key)
        self.deps.metrics.snapshot_bytes.inc(staged.written)
        self._observe_answer(report)
        if intent is not None and self.draining:
            return self._stop_at_boundary(slot)  # the turn is kept; its effect waits
        return reply

    async def _on_journal_begin(
        self,
        slot: DispatchSlot,
        report: JournalBegin,
        before: Callable[[SessionState], Sequence[Event]] | None = None,
    ) -> Reply:
        """Decide a side-effecting call's intent; ``before`` gives the events logged ahead of the
        decision in the same append, whatever it is (the pointer of the turn that made the
        call, and what its report carried)."""
        agent_key = f"{self.session_id}/{report.agent}"
        size = len(msgspec.json.encode(report.args))
        limit = self.deps.limits.max_tool_args_bytes

        def decision(state: SessionState) -> tuple[list[Event], tuple[Reply, bool]]:
            entry = state.journal.get((report.agent, report.key))
            if entry is not None and entry.outcome in ("ok", "error"):
                self.deps.metrics.journal_hits.inc()
                reply = Reply(
                    "ok", decision="done", result=entry.result or "", outcome=entry.outcome
                )
                return [], (reply, False)
            if entry is not None and report.key in slot.intents and not report.interrupted:
                # The same dispatch asking again after a lost reply.
                return [], (Reply("ok", decision="run"), False)
            if entry is not None:
                return self._unknown_outcome(state, slot, report, entry.outcome)
            if size > limit:
                message = f"tool arguments of {size} bytes are over the limit of {limit}"
                return [], (Reply("error", message=message), False)
            intent = ToolCallIntent(
                report.agent, report.key, report.tool, report.args, idempotent=report.idempotent
            )
            return [intent], (Reply("ok", decision="run"), True)

        def rule(state: SessionState) -> tuple[list[Event], tuple[Reply, bool]]:
            events, answer = decision(state)
            return [*(before(state) if before is not None else ()), *events], answer

        reply, new_intent = await self.decide(rule)
        if reply.decision == "run":
            slot.intents.add(report.key)
        if reply.decision == "probe":
            slot.probes.add(report.key)
        if new_intent:
            self._copy_to_journal(agent_key, report.key, {"tool": report.tool, "args": report.args})
        return reply

    def _unknown_outcome(
        self, state: SessionState, slot: DispatchSlot, report: JournalBegin, outcome: str | None
    ) -> tuple[list[Event], tuple[Reply, bool]]:
        """An intent with no result from an earlier dispatch, or from this one when its run
        was interrupted (``report.interrupted``): the outcome is unknown. A tool with
        a probe is asked first (the worker runs it where the effect runs): an effect that
        happened comes back as its result (``JournalFinish``, ``resolved_by="probe"``), one
        that did not runs now under a new intent (``resolution="not_happened"``, same key).
        Only without a probe, or when it cannot tell, does ``on_unknown`` decide."""
        if report.probe and not report.probed:
            return [], (Reply("ok", decision="probe"), False)
        if report.probed == "not_happened" and report.key in slot.probes:
            intent = ToolCallIntent(
                report.agent,
                report.key,
                report.tool,
                report.args,
                idempotent=report.idempotent,
                resolution="not_happened",
            )
            return [intent], (Reply("ok", decision="run"), False)
        why = f" (its probe cannot tell: {report.probe_reason})" if report.probed else ""
        if report.interrupted:
            why = f" (the call was interrupted: {report.interrupted}){why}"
        if report.on_unknown == "rerun" and report.idempotent:
            intent = ToolCallIntent(
                report.agent, report.key, report.tool, report.args, idempotent=True
            )
            return [intent], (Reply("ok", decision="run"), False)
        acknowledged = decisions.acknowledged_unknown(state, report.agent, report.key)
        if outcome == "unknown" and report.on_unknown == "hold" and acknowledged:
            message = "the operator resumed past this unknown outcome"
            return [], (Reply("ok", decision="failed", message=message), False)
        if report.on_unknown == "hold" and not acknowledged:
            events: list[Event] = []
            if outcome is None:
                events.append(
                    ToolCallRecorded(
                        report.agent,
                        report.key,
                        report.tool,
                        "unknown",
                        f"outcome unknown: held for an operator{why}",
                    )
                )
            message = f"outcome of {report.tool} unknown"
            return events, (Reply("ok", decision="hold", message=message), False)
        events = []
        if outcome is None:
            events.append(
                ToolCallRecorded(
                    report.agent,
                    report.key,
                    report.tool,
                    "unknown",
                    f"outcome unknown after {'an interruption' if report.interrupted else 'a crash'}; not re-run{why}",
                )
            )
        message = "a crash interrupted this call and it is not idempotent, so it was not run again"
        return events, (Reply("ok", decision="failed", message=message), False)

    def _copy_to_journal(self, agent_key: str, call_key: str, record: dict[str, Any]) -> None:
        """Keep LMDB's copy of a journal entry the log already holds (an intent, or a result
        replacing it) until the agent's next store write (a snapshot, or its ``Done``), which
        commits it with that. Nothing waits for it: the log is what makes the entry durable, and
        nothing decides from the copy."""
        self._unwritten_copies.setdefault(agent_key, {})[call_key] = msgspec.msgpack.encode(record)

    def _keep_copies(self, agent_key: str, copies: dict[str, bytes]) -> None:
        """Journal copies a failed store write did not take, kept for the next one (a copy
        taken since, newer, wins)."""
        kept = self._unwritten_copies.setdefault(agent_key, {})
        for key, value in copies.items():
            kept.setdefault(key, value)

    def _journal_copies(self, agent_key: str) -> dict[str, bytes]:
        """The journal copies kept for the agent's next store write (taken: the caller writes
        them, or gives them back with ``_keep_copies`` when its write fails)."""
        return self._unwritten_copies.pop(agent_key, {})

    def _copy_results(self, agent_key: str, recorded: Sequence[ToolCallRecorded]) -> None:
        """Keep LMDB's copies of results the log now holds, each replacing its intent's."""
        for r in recorded:
            record = {"tool": r.tool, "outcome": r.outcome, "result": r.result}
            self._copy_to_journal(agent_key, r.key, record)

    async def _on_journal_finish(self, slot: DispatchSlot, report: JournalFinish) -> Reply:
        if report.resolved_by and (report.resolved_by != "probe" or report.key not in slot.probes):
            return Reply("error", message="a probe's answer that was not asked for")

        def rule(state: SessionState) -> tuple[list[Event], Reply | None]:
            entry = state.journal.get((report.agent, report.key))
            if entry is None:
                return [], Reply("error", message="a result with no intent")
            if entry.outcome in ("ok", "error"):
                return [], Reply("ok")
            recorded = ToolCallRecorded(
                report.agent,
                report.key,
                report.tool,
                report.outcome,
                report.result,
                resolved_by=report.resolved_by,
            )
            return [recorded], None

        early = await self.decide(rule)
        if early is not None:
            return early
        agent_key = f"{self.session_id}/{report.agent}"
        record = {"tool": report.tool, "outcome": report.outcome, "result": report.result}
        self._copy_to_journal(agent_key, report.key, record)  # stored with the node's snapshot
        return Reply("ok")

    async def _on_hitl(self, report: HitlAsk) -> Reply:
        def rule(state: SessionState) -> tuple[list[Event], Reply]:
            if report.pause_id in state.hitl_answers:
                answer = state.hitl_answers[report.pause_id]
                return [], Reply("ok", decision="answered", result=answer)
            if report.pause_id in state.hitl_pending:
                return [], Reply("ok", decision="paused")
            paused = HitlPaused(report.agent, report.pause_id, report.question)
            return [paused], Reply("ok", decision="paused")

        return await self.decide(rule)

    async def _on_job(self, report: JobStart) -> Reply:
        """Start an agent's async job once: jobs are named by (agent, job id), so two agents making
        the same call each get their own job and result; a job whose tool declares a side effect
        is logged as one."""
        key = (report.agent, report.job_id)
        size = len(msgspec.json.encode(report.args))
        limit = self.deps.limits.max_tool_args_bytes

        def rule(state: SessionState) -> tuple[list[Event], Reply | AsyncJobStarted]:
            done = state.jobs_done.get(key)
            if done is not None:
                result = done.result if done.ok else f"error: {done.result}"
                return [], Reply("ok", decision="done", result=result)
            if key in state.jobs_in_flight:
                return [], Reply("ok", decision="waiting")
            tool = self.deps.plugins.tools().get(report.tool)
            if tool is None or not tool.async_job:
                message = f"no tool {report.tool!r} to run as a job on the daemon"
                return [], Reply("error", message=message)
            if size > limit:
                message = f"job arguments of {size} bytes are over the limit of {limit}"
                return [], Reply("error", message=message)
            job = AsyncJobStarted(
                report.agent,
                report.job_id,
                report.tool,
                report.args,
                side_effect=tool.side_effect,
                idempotent=tool.idempotent,
            )
            return [job], job

        answer = await self.decide(rule)
        if isinstance(answer, Reply):
            return answer
        self.start_job(answer)
        return Reply("ok", decision="waiting")

    def start_job(self, job: AsyncJobStarted) -> None:
        """Run an async job on the daemon; its completion is appended and wakes the agent."""
        from apomesh.runtime.agent_loop import LoopContext, make_workspace

        key = (job.agent, job.job_id)

        async def run_job() -> None:
            tool = self.deps.plugins.tools()[job.tool]
            config = self.state.agents[job.agent].current_config
            assert config is not None  # every agent is born with its config
            ctx = LoopContext(
                Run(self.session_id, job.agent, 0, config, "job", ""),
                worker_id="daemon",
                workspace_root=self.deps.workspace,
                send=_no_send,
                idempotency_key=idempotency_key(self.session_id, job.agent, job.job_id),
            )
            try:
                await make_workspace(ctx.workspace)
                result, ok = await tool.run(ctx, job.args), True
            except Exception as exc:
                result, ok = f"{type(exc).__name__}: {exc}", False

            def finished(state: SessionState) -> tuple[list[Event], None]:
                if key not in state.jobs_in_flight:
                    return [], None
                return [AsyncJobFinished(job.agent, job.job_id, ok, result)], None

            with contextlib.suppress(Fenced):  # the session ended (or moved) meanwhile
                await self.decide(finished)

        task = self.deps.spawn(run_job())
        self._jobs[key] = task
        task.add_done_callback(
            lambda done: self._jobs.pop(key, None) if self._jobs.get(key) is done else None
        )

    async def _take_up_job(
        self, job: AsyncJobStarted, recovered: Literal["auto", "operator"] | None
    ) -> None:
        """A job an earlier writer started and never saw finish (a crash or a restart cut it
        short): its outcome is unknown. A read-only job runs again. A side-effecting one is never
        run again silently: its tool's ``on_unknown`` decides, as for a journaled call: ``rerun``
        (an idempotent tool only) runs it again, ``hold`` holds the session for an operator (the
        operator's resume then fails it), anything else fails it: the agent sees the job's error."""
        if not job.side_effect:
            self.start_job(job)
            return
        tool = self.deps.plugins.tools().get(job.tool)
        policy = tool.on_unknown if tool is not None else "fail"
        if policy == "rerun" and job.idempotent:
            log.warning(
                "session %s: job %s %s of %s had an unknown outcome; its tool is idempotent, "
                "so it runs again",
                self.session_id,
                job.tool,
                job.job_id[:12],
                job.agent,
            )
            self.start_job(job)
            return
        if policy == "hold" and recovered != "operator":
            self.held_reason = (
                f"held for an operator: outcome of job {job.tool} {job.job_id[:12]} unknown"
            )
            raise Held(self.held_reason)
        if policy == "hold":
            why = "the operator resumed past this unknown outcome; the job was not run again"
        else:
            why = "a crash interrupted this job and it is not idempotent, so it was not run again"
        await self.append(
            AsyncJobFinished(job.agent, job.job_id, False, f"outcome unknown: {why}", unknown=True)
        )

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
    def checkpoint(self) -> Checkpoint | None:
        cp = self.state.checkpoint
        return Checkpoint(cp.position, cp.state) if cp is not None else None

    async def save_checkpoint(self, position: str, state: bytes) -> None:
        if self._replaying:
            # A replayed loop re-saving a checkpoint the log holds: it is there again. Looked for
            # after the loop's position first, then (before the first save of a recovered loop,
            # which may walk from the start) anywhere.
            after = [self._cursor] if self._saved else [self._cursor, -1]
            for bound in after:
                for index, logged in self.state.checkpoints:
                    if index > bound and logged.position == position and logged.state == state:
                        self._cursor, self._asks, self._saved = index, 0, True
                        return
            self._replaying = False
        self._saved = True
        self._cursor = await self.append(CoordinatorCheckpoint(position=position, state=state))
        self._asks = 0

    async def ask_root(self, purpose: str, prompt: str) -> RootAnswer:
        if purpose not in ROOT_PURPOSES:
            raise DefinitionError(
                f"ask_root purpose {purpose!r} is not one of {', '.join(ROOT_PURPOSES)}",
                where="coordination kind",
            )
        self._asks += 1
        ask = f"{self._cursor}:{self._asks}"
        digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]
        where = f"ask_root #{self._asks} after checkpoint {self._cursor}"
        recorded = self.state.answers.get(ask)
        if recorded is not None:
            # Answered before the crash: the answer comes back from the log, by its position.
            self._recovering = False
            if recorded.purpose != purpose:
                raise Nondeterminism(
                    "the replayed loop asks the root for something else here",
                    where=where,
                    logged=f"purpose {recorded.purpose}",
                    now=f"purpose {purpose}",
                )
            if recorded.prompt_digest is not None and recorded.prompt_digest != digest:
                raise Nondeterminism(
                    "the replayed loop asks the root another prompt here",
                    where=where,
                    logged=f"prompt sha256 {recorded.prompt_digest}",
                    now=f"prompt sha256 {digest}",
                )
            return RootAnswer(plan=recorded.plan, final=recorded.final)
        root = self.state.agents[self.state.root or "root"]
        if (
            self._recovering
            and root.ask is None
            and root.purpose == purpose
            and root.phase in ("planned", "completed")
        ):
            # A log written before asks carried their position: the root's last answer, as then.
            self._recovering = False
            return _answer(root)
        self._recovering = False
        await self.drive_agent(root.ref, purpose=purpose, prompt=prompt, ask=(ask, digest))
        root = self.state.agents[root.ref]
        if root.phase not in ("planned", "completed"):
            raise AgentFailed(f"the root agent ended {root.phase}: {root.reason or ''}".strip())
        return _answer(root)

    async def run_children(
        self,
        batch: str,
        tasks: list[str],
        *,
        role: str = "worker",
        max_parallel: int = 4,
        done_when: DoneWhen | None = None,
    ) -> list[ChildResult]:
        self._recovering = False
        root = self.state.root or "root"
        config = self.shape.roles.get(role)
        if config is None:
            raise AgentFailed(f"the session has no role {role!r}")
        latest = self._batch_children(root, batch)
        for index, child in sorted(latest.items()):
            logged_role = child.config.role if child.config is not None else role
            if index >= len(tasks) or child.task != tasks[index] or logged_role != role:
                raise Nondeterminism(
                    "a replayed batch differs from the logged one",
                    where=f"batch {batch!r} task {index}",
                    logged=f"{logged_role}: {child.task}",
                    now=f"{role}: {tasks[index]}" if index < len(tasks) else "(no such task)",
                )
        results: dict[int, ChildResult] = {}
        for index, child in latest.items():
            if child.terminal and child.reason != SUPERSEDED:
                # Ended on the log (completed, failed, or cancelled by ``done_when``): its result
                # is that terminal event; a failed child is not run again under a new ref.
                results[index] = _result(child)
        gate = asyncio.Semaphore(max_parallel)

        async def one(index: int, task: str) -> ChildResult:
            async with gate:
                child = latest.get(index)
                if (
                    child is not None
                    and not child.terminal
                    and self.fresh_children
                    and child.pauses == 0
                ):
                    # An auto-resume starts children afresh; one that asked a human keeps its
                    # ref, so the pause its operator sees stays the one that is answered.
                    await self.append(AgentLifecycle(child.ref, "cancelled", reason=SUPERSEDED))
                    child = None
                if child is None or child.terminal:

                    def birth(state: SessionState) -> tuple[list[Event], str]:
                        # Decided by the writer: concurrent births never pick the same ref.
                        ref = decisions.next_child_ref(state, root)
                        born = AgentLifecycle(
                            ref,
                            "born",
                            parent=root,
                            config=config,
                            task=task,
                            task_index=index,
                            batch=batch,
                        )
                        return [born], ref

                    child = self.state.agents[await self.decide(birth)]
                await self.drive_agent(child.ref, purpose="act", prompt=task)
                return _result(self.state.agents[child.ref])

        def finished() -> list[ChildResult]:
            return [results[i] for i in sorted(results)]

        if done_when is not None and results and done_when(finished()):
            pending: dict[asyncio.Task[ChildResult], int] = {}
        else:
            pending = {
                asyncio.ensure_future(one(i, t)): i for i, t in enumerate(tasks) if i not in results
            }
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    results[pending.pop(task)] = task.result()
                if pending and done_when is not None and done_when(finished()):
                    break
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        latest = self._batch_children(root, batch)  # with any born while it was cancelled
        for index, task_text in enumerate(tasks):
            if index in results:
                continue
            unfinished = latest.get(index)
            if unfinished is not None and not self.state.agents[unfinished.ref].terminal:
                await self.append(
                    AgentLifecycle(unfinished.ref, "cancelled", reason=BATCH_DONE_EARLY)
                )
            ref = unfinished.ref if unfinished is not None else ""
            results[index] = ChildResult(ref, task_text, index, False, reason=BATCH_DONE_EARLY)
        return finished()

    def _batch_children(self, root: str, batch: str) -> dict[int, AgentView]:
        """The latest child born for each task of ``batch``, by task index."""
        latest: dict[int, AgentView] = {}
        for ref in self.state.children_of(root):
            child = self.state.agents[ref]
            if child.batch == batch and child.task_index is not None:
                latest[child.task_index] = child
        return latest

    # --- driving one agent -------------------------------------------------------------------------

    async def drive_agent(
        self, ref: str, *, purpose: str, prompt: str, ask: tuple[str, str] | None = None
    ) -> None:
        """Run one agent until it answers (or fails), re-dispatching it when its worker is lost."""
        driver = asyncio.current_task()
        assert driver is not None
        self._drivers.add(driver)
        agent = {
            "apomesh.session_id": self.session_id,
            "apomesh.agent": ref,
            "apomesh.purpose": purpose,
        }
        try:
            await tracing.traced(
                self._drive(ref, purpose=purpose, prompt=prompt, ask=ask), "apomesh.agent", agent
            )
        finally:
            self._drivers.discard(driver)

    async def _drive(
        self, ref: str, *, purpose: str, prompt: str, ask: tuple[str, str] | None
    ) -> None:
        agent = self.state.agents[ref]
        resume_reason: str | None = None
        lost_worker: str | None = None
        if agent.phase in ("dispatched", "running", "waiting", "paused") and agent.epoch > 0:
            restarted = self.fresh_children or self.recovered == "auto"
            resume_reason = "daemon restart" if restarted else "operator resume"
            lost_worker = agent.worker
        resuming = False
        refused = 0
        ended: DispatchSlot | None = None
        while True:
            if ended is not None:
                # A report of the ended dispatch still being decided (its snapshot stored, its
                # pointer not yet appended) finishes first, and its deferred node is logged:
                # the next dispatch continues from it.
                async with ended.lock:
                    await self._log_deferred_or_drop(ended)
                ended = None
            await self.wait_for(lambda: self._ready_to_dispatch(ref))
            if self.held_reason:
                raise Held(self.held_reason)
            if self.draining:
                raise Drained(f"{ref} not dispatched: the daemon is shutting down")
            moved_to = self._migrated_config(agent)
            config = moved_to or agent.current_config
            assert config is not None
            worker_id = await self.deps.workers.pick(
                config,
                prefer=agent.worker,
                pins=worker_pins(self.deps.plugins, self.state.plugin_pins, config),
                who=f"session {self.session_id} agent {ref}",
                stop=lambda: self.draining,
            )
            if worker_id is None:
                raise Drained(f"{ref} not dispatched: the daemon is shutting down")
            if self.held_reason:
                self.deps.workers.release(worker_id)
                raise Held(self.held_reason)
            try:
                epoch = agent.epoch + 1
                agent_key = f"{self.session_id}/{ref}"
                if agent.epoch == 0 and agent.snapshot_id is None:
                    # Never dispatched: no worker ever stored anything of it.
                    self.deps.snapshots.fresh(agent_key)
                    memory = None
                else:
                    memory = await self.deps.snapshots.load_logged(agent_key, agent.snapshot_id)
                # A resumed agent's ``resuming`` goes in one append with its ``dispatched``.
                opening: list[Event] = []
                if resume_reason is not None:
                    opening.append(
                        AgentResuming(
                            ref,
                            reason=resume_reason,
                            worker=lost_worker,
                            snapshot_id=agent.snapshot_id,
                            epoch=epoch,
                        )
                    )
                await self.append(
                    *opening,
                    AgentLifecycle(
                        ref,
                        "dispatched",
                        worker=worker_id,
                        epoch=epoch,
                        purpose=purpose,
                        config=moved_to,
                        ask=ask[0] if ask else None,
                        prompt_digest=ask[1] if ask else None,
                    ),
                )
                if resume_reason is not None:
                    tracing.add_event("resuming", {"reason": resume_reason, "apomesh.epoch": epoch})
                    if _path_label(resume_reason) == "worker_lost":
                        # Agents re-dispatched by a session's own recovery are counted with it.
                        self.deps.metrics.resumes.labels("worker_lost").inc()
                    resuming = True
                    resume_reason = None
                tracing.add_event(
                    "dispatched", {"apomesh.worker_id": worker_id, "apomesh.epoch": epoch}
                )
                dispatch = self.deps.workers.track(worker_id, self.session_id, ref, epoch)
                slot = DispatchSlot(ref, epoch, worker_id, dispatch)
                self.slots[ref] = slot
                run = self._fit_to_payload(
                    slot,
                    Run(
                        session_id=self.session_id,
                        agent=ref,
                        epoch=epoch,
                        config=config,
                        purpose=purpose,
                        prompt=prompt,
                        task=agent.task or "",
                        task_index=agent.task_index or 0,
                        memory=memory,
                        incarnation=self.deps.incarnation,
                        answered_step=self.state.agents[ref].answered_step,
                        node_delay=self.deps.node_commit_delay,
                    ),
                )
                try:
                    if not await self.deps.workers.send_run(worker_id, run):
                        resume_reason, lost_worker = "dispatch not acknowledged", worker_id
                        # Backing off: a worker that keeps refusing never floods the log.
                        await asyncio.sleep(min(0.2 * 2**refused, 5.0))
                        refused += 1
                        continue
                    refused = 0
                    done = await slot.future
                except Drained:
                    # Stopped at a node boundary: that node is stored and logged before the
                    # session can be marked suspended (it waits for this slot to go).
                    async with slot.lock:
                        await self._log_deferred_or_drop(slot)
                    raise
                except PayloadTooLarge as exc:
                    # Never sendable, however often it is tried: the agent fails, once, saying why.
                    reason = f"the dispatch cannot be sent: {exc.message}"
                    done = Done(worker_id, self.session_id, ref, epoch, "failed", reason=reason)
                except WorkerLost as lost:
                    resume_reason, lost_worker = lost.reason, lost.worker_id
                    continue
                except asyncio.CancelledError:
                    with contextlib.suppress(Exception):
                        await self.deps.workers.send_cancel(
                            worker_id, self.session_id, ref, epoch, "session cancelled"
                        )
                    raise
                finally:
                    self.deps.workers.untrack(dispatch)
                    ended = slot
                    if self.slots.get(ref) is slot:
                        del self.slots[ref]
                    if slot.future.done() and not slot.future.cancelled():
                        slot.future.exception()  # a loss noticed while the dispatch was refused
            finally:
                self.deps.workers.release(worker_id)
            if resuming:
                await self.append(AgentResumed(ref, epoch=epoch))
                resuming = False
            if await self._settle(ref, done, purpose):
                return

    def _fit_to_payload(self, slot: DispatchSlot, run: Run) -> Run:
        """The dispatch as it is sent: with the agent's memory while that fits in a page, else
        without it (the worker fetches it from ``slot`` in pages), so a conversation of any size
        can be dispatched again."""
        page = self.deps.workers.page_bytes
        if run.memory is None or len(ENCODER.encode(run)) <= page:
            return run
        slot.memory = ENCODER.encode(run.memory)
        slot.page_bytes = page
        pages = -(-len(slot.memory) // page)
        return msgspec.structs.replace(run, memory=None, memory_pages=pages)

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
        if self.held_reason or self.draining:
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

    def recovered_event(self, recovered: Literal["auto", "operator"]) -> SessionRecovered:
        """The ``SessionRecovered`` a resumed session opens with (``start`` appends it, unless
        its opener appended it already: ``recovery_logged``)."""
        return SessionRecovered(
            path=recovered,
            checkpoint_index=self.state.checkpoint_index,
            incarnation=self.deps.incarnation,
        )

    def start(
        self,
        recovered: Literal["auto", "operator"] | None = None,
        *,
        recovery_logged: bool = False,
    ) -> None:
        self.recovered = recovered
        session = {"apomesh.session_id": self.session_id, "apomesh.recovered": recovered or ""}
        self.task = asyncio.create_task(
            tracing.traced(self._run(recovered, recovery_logged), "apomesh.session", session),
            name=f"session-{self.session_id}",
        )

    async def _run(
        self, recovered: Literal["auto", "operator"] | None, recovery_logged: bool
    ) -> None:
        shape = self.shape
        try:
            if recovered is not None:
                if not recovery_logged:
                    await self.append(self.recovered_event(recovered))
                self.deps.metrics.resumes.labels(recovered).inc()
            root = self.state.root
            if root is not None and root not in self.state.agents:
                # A crash between SessionStarted and the root's birth (one step, two appends).
                await self.append(
                    AgentLifecycle(
                        root, "born", config=shape.root, task=self.state.goal, task_index=0
                    )
                )
            self.opened.set()
            for job in list(self.state.jobs_in_flight.values()):
                await self._take_up_job(job, recovered)
            kind = self.deps.plugins.coordination_kinds()[shape.coordination]
            output = await kind.run(self)
            await self.append(SessionEnded(status="completed", output=output))
        except asyncio.CancelledError:
            raise
        except Drained:
            with contextlib.suppress(ApomeshError):
                await self._suspend()
            return
        except Held as held:
            log.warning("session %s held for an operator: %s", self.session_id, held)
            await self._stop_for_hold()
            reason, category = f"held for an operator: {held}", "held"
            if str(held).startswith(MODEL_CALL_FAILED):
                # The provider's own message says what the operator must fix before resuming.
                reason, category = str(held).removeprefix("held: "), "model_failed"
            await self.deps.on_end(self, Ending("stranded", reason=reason, category=category))
            return
        except (LogUnavailable, StoreUnavailable) as exc:
            if self.state.terminal or self.conflict is not None or self.stopped:
                return
            # Nothing is decided on a guess, and a passing outage must not end the session
            # failed: it stops here, and the registry drives it again from its log (as after a
            # worker loss) once NATS answers.
            log.warning(
                "session %s stopped: %s; it is driven again from its log once NATS answers",
                self.session_id,
                exc,
            )
            self.deps.spawn(self.deps.on_end(self, Ending("unavailable", reason=str(exc))))
        except Exception as exc:
            if self.state.terminal or self.conflict is not None or self.stopped:
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
            self.opened.set()
            tracing.set_attributes({"apomesh.status": self.state.status})
            if self.state.terminal:
                await self.deps.on_end(self, Ending("finished"))

    async def _stop_for_hold(self) -> None:
        """One agent's hold stops the whole session before it is stranded: every other agent's
        driver is stopped (its dispatch cancelled on its worker) and every job this writer runs
        is cancelled, so nothing runs or appends while the session waits for an operator."""
        current = asyncio.current_task()
        tasks = [t for t in [*self._drivers, *self._jobs.values()] if t is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def cancel(self, *, by: str) -> None:
        """The operator's cancel: logged (refused once the session has ended), the coordinator
        and every dispatch stopped, and the session ended ``cancelled``."""
        await self.append(OperatorAction(action="cancel", by=by))
        reason = f"cancelled by {by}"
        await self.stop()
        for slot in list(self.slots.values()):
            with contextlib.suppress(Exception):
                await self.deps.workers.send_cancel(
                    slot.worker_id, self.session_id, slot.agent, slot.epoch, reason
                )
        if not self.state.terminal:
            await self.append(SessionEnded(status="cancelled", reason=reason))
            await self.deps.on_end(self, Ending("finished"))

    async def stop(self) -> None:
        """Stop driving (daemon shutdown, or another writer): the log keeps everything."""
        if (
            self.task is not None
            and not self.task.done()
            and self.task is not asyncio.current_task()
        ):
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task

    async def retire(self) -> None:
        """Stop driving for good, before another writer folds the log (after a conflict, or
        NATS not answering): nothing more is appended here, and this returns once no append of
        this writer is in flight (the one in flight ends with its attempt), so that fold sees
        this writer's last word."""
        self.stopped = True
        await self.stop()
        async with self._writer:
            return


async def _no_send(report: Report) -> Reply:
    raise ApomeshError("an async job cannot report to the daemon")


SUPERSEDED = "superseded by a fresh agent after a daemon restart"
"""The reason of a child an auto-resume cancelled to start its task afresh (born again)."""


def _result(child: AgentView) -> ChildResult:
    """A child's result in its batch, from its terminal event."""
    ok = child.phase == "completed"
    return ChildResult(
        child.ref,
        child.task or "",
        child.task_index or 0,
        ok,
        child.output or "",
        child.reason or "",
    )


def _continues(report: NodeReport) -> bool:
    """Whether the agent goes on after this node (its last message is not its answer or plan, so
    no ``Done`` follows it)."""
    return bool(report.new_messages) and report.new_messages[-1].role != "assistant"


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


def _refusal(rule: Rule[Any], state: SessionState) -> CommandRefused | NotFound | None:
    """The ``CommandRefused`` or ``NotFound`` a rule raises against an ended session's state, if
    it refuses the command by itself; None when it would have written, or fails otherwise (a rule
    written for a live session: the session's end is then the answer)."""
    try:
        rule(state)
    except (CommandRefused, NotFound) as refused:
        return refused
    except Exception:  # any other failure: the end is the answer
        return None
    return None
