"""The daemon's sessions: which it drives (live), which wait for an operator (stranded), their
leases, their completed records, and the one answer to "what is session X's state".

``SessionRegistry`` is the only way a session is opened, adopted, stranded or finished on this
daemon: ``adopt`` takes the session's lease, builds its writer, logs the events that open it (a new
session's ``SessionStarted``, an operator's actions), starts it, and rolls all of it back when any
step fails; ``end`` is every writer's ``on_end`` callback (finished, stranded for an operator, or
lost to another writer after an append conflict: a session left to a writer elsewhere is handed
to ``let_go``, the takeover's watch). ``state(session_id)`` answers from the live
writer, else the stranded entry, else the fold cache over the log. A lease is taken when a session
is opened here and given back when this daemon stops driving it; nothing renews it (the daemon's
presence record, renewed once for all, keeps it alive), and a lease of a live session seen taken
by another owner (``watch_leases``) stops this daemon's writer, as an append conflict does. At shutdown ``drain`` lets every
live session stop at a node boundary and mark itself suspended for the next daemon, within a grace
period, before ``stop_all`` cuts off the rest; with live peers, ``hand_over`` then gives the leases
of the suspended sessions back so that a peer adopts them at once. A write for a session whose
lease another daemon holds is refused with ``OwnedElsewhere`` naming it (and its URL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Literal

import msgspec

from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.core.errors import (
    ApomeshError,
    AppendConflict,
    LogUnavailable,
    NotFound,
    OwnedElsewhere,
    StoreUnavailable,
)
from apomesh.core.events import Event
from apomesh.core.ports import EventLog, SessionLeases
from apomesh.core.state import SessionState
from apomesh.runtime.fold_checkpoints import FoldCheckpoints
from apomesh.runtime.folds import FoldCache
from apomesh.runtime.sessions import Ending, SessionRuntime
from apomesh.runtime.snapshots import SnapshotStore

log = logging.getLogger("apomesh.daemon")

LEASE_RENEW_SECONDS = 5.0
"""The longest pause between two renewals of the daemon's presence record (which keeps every
lease it holds alive)."""


READOPT_LIMIT = 3
"""Conflicts in a row after which the lease holder leaves a session to the log (``_drive_again``)."""

READOPT_PAUSE = 0.2
"""Seconds (times the try) the lease holder waits before it drives a session on after a conflict."""

UNAVAILABLE_PAUSE = 1.0
"""Seconds before a session stopped by NATS not answering is folded and driven again (doubled
after each try NATS still does not answer, up to ``UNAVAILABLE_PAUSE_MAX``)."""

UNAVAILABLE_PAUSE_MAX = 30.0

COMPLETED_PER_WRITE = 100
"""Completed records to one store write in ``write_completed_many``: each write is one atomic
batch of a replicated (R3) state bucket, which holds at most 1,000 messages (a record is one, or
a few parts when it is over a message's size)."""


def renew_interval(ttl: float) -> float:
    """How often the presence record is renewed for a lease TTL: a third of it, at most
    ``LEASE_RENEW_SECONDS``, so it survives two missed renewals before it can age out."""
    return min(LEASE_RENEW_SECONDS, ttl / 3)


class Recoverable(msgspec.Struct):
    """A session on the recoverable list: stranded, waiting for an operator."""

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

IDEMPOTENCY_DB = "idempotency"
"""The store database of ``Idempotency-Key`` -> the session its first request started."""


class IdempotencyRecord(msgspec.Struct, frozen=True):
    """What an ``Idempotency-Key`` answers: the session its first request started."""

    session_id: str
    request: str
    """SHA-256 of the request's goal, agent and definition."""


MakeRuntime = Callable[[SessionState, bool], SessionRuntime]
"""Builds a session's writer over ``state`` (``fresh_children``) with the daemon's collaborators."""


class SessionRegistry:
    """Live and stranded sessions, their leases, and the one state lookup."""

    def __init__(
        self,
        *,
        log_adapter: EventLog,
        leases: SessionLeases,
        store: AsyncStore,
        snapshots: SnapshotStore,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
        logger: logging.Logger | None = None,
    ) -> None:
        self.owner_url: Callable[[str | None], str] = lambda _owner: ""
        """The advertised URL of a lease owner (set by the daemon from the presence records)."""
        self.changed: Callable[[], None] = lambda: None
        """Called when the set of live or stranded sessions changes (the presence record)."""
        self.closing: Callable[[], bool] = lambda: False
        """True once the daemon drains or closes (set by the daemon): no session is driven
        again then."""
        self.log_adapter = log_adapter
        self.leases = leases
        self.store = store
        self.snapshots = snapshots
        self.spawn = spawn
        self.log = logger or log
        self.owner = ""
        """The lease owner name: the daemon's stable id (set when the daemon starts)."""
        self.let_go: Callable[[str], None] = lambda session_id: None
        """Called with a session whose writer stopped here after a conflict, left to another
        writer or to none (set by the daemon: its takeover makes sure a live daemon drives it)."""
        self.make_runtime: MakeRuntime | None = None
        """Set by the daemon once the writers' collaborators exist (their ``on_end`` is ``end``)."""
        self.live: dict[str, SessionRuntime] = {}
        self.stranded: dict[str, Recoverable] = {}
        self._readopted: dict[str, int] = {}
        """Sessions driven again after a stale writer's conflict, and how many times in a row."""
        self._left_winding_down: set[str] = set()
        """Sessions whose writer stopped on a conflict or NATS not answering once this daemon
        was winding down, so not driven again here: their leases are still held here, and
        ``hand_over`` gives them back with the rest."""
        self.fold_checkpoints = FoldCheckpoints(store, logger=self.log)
        """Sessions' folded-state checkpoints: a session to adopt is folded from its latest."""
        self.folds = FoldCache(
            log_adapter.read,
            start=lambda session_id: self.fold_checkpoints.fold(log_adapter, session_id),
        )
        """Sessions this daemon does not drive (ended ones above all) are read through this
        cache, so a request folds only what was appended since the last one."""

    # --- lookups ---------------------------------------------------------------------------------

    def writer(self, session_id: str) -> SessionRuntime | None:
        """The live writer of the session on this daemon, if it drives it."""
        return self.live.get(session_id)

    async def state(self, session_id: str) -> SessionState:
        """The folded state of any session: live in memory, stranded, else folded from the log
        (``NotFound`` without events; a log that cannot be folded raises its fold error)."""
        runtime = self.live.get(session_id)
        if runtime is not None:
            return runtime.state
        rec = self.stranded.get(session_id)
        if rec is not None and rec.state is not None:
            return rec.state
        return await self.folds.state(session_id)

    # --- opening and ending ----------------------------------------------------------------------

    async def adopt(
        self,
        state: SessionState,
        *,
        recovered: Literal["auto", "operator"] | None,
        fresh_children: bool,
        opening: Sequence[Event] = (),
        start: bool = True,
    ) -> SessionRuntime:
        """Take the session's lease, build its writer, log ``opening`` through it and start it.
        Any failure rolls all of it back: the session is stranded again if it was, and no lease
        or half-opened writer is left behind."""
        session_id = state.session_id
        if session_id in self.live:
            raise ApomeshError(f"session {session_id} is already running")
        assert self.make_runtime is not None, "the daemon sets make_runtime before any session"
        stranded = self.stranded.pop(session_id, None)
        runtime = self.make_runtime(state, fresh_children)
        # Claimed before the first await: a concurrent open of the same session (two operators
        # resuming it) is refused above, never a second writer.
        self.live[session_id] = runtime
        leased = False
        # An operator's resume: its actions and the session's ``recovered`` in one append.
        recovery = [runtime.recovered_event(recovered)] if opening and recovered and start else []
        try:
            leased = await self.leases.acquire(session_id, self.owner)
            if not leased:
                holder = await self.lease_owner(session_id)
                raise OwnedElsewhere(session_id, holder or "another daemon", self.owner_url(holder))
            if opening:
                await runtime.append(*opening, *recovery)
        except BaseException:
            if self.live.get(session_id) is runtime:
                del self.live[session_id]
            if stranded is not None:
                self.stranded[session_id] = stranded
            if leased:
                with contextlib.suppress(Exception):
                    await self.leases.release(session_id, self.owner)
            raise
        self.folds.forget(session_id)
        self.changed()
        if start:
            runtime.start(recovered, recovery_logged=bool(recovery))
        return runtime

    async def adopt_many(
        self, states: Sequence[SessionState], *, fresh_children: Callable[[SessionState], bool]
    ) -> tuple[list[SessionRuntime], list[SessionState]]:
        """``adopt`` without an opening and without starting, for many sessions at once (the
        boot scan's auto-resumable ones): each is claimed before any await, as ``adopt`` claims
        one, and their leases are asked for together (``acquire_many``). Answers the runtimes
        adopted and the states whose lease was not taken (held by a live owner, or not answered
        for): those are rolled back as a failed ``adopt`` is."""
        assert self.make_runtime is not None, "the daemon sets make_runtime before any session"
        claimed: list[tuple[SessionRuntime, Recoverable | None]] = []
        refused: list[SessionState] = []
        for state in states:
            session_id = state.session_id
            if session_id in self.live:
                refused.append(state)
                continue
            runtime = self.make_runtime(state, fresh_children(state))
            claimed.append((runtime, self.stranded.pop(session_id, None)))
            self.live[session_id] = runtime
        taken: set[str] = set()
        adopted: list[SessionRuntime] = []
        try:
            taken = await self.leases.acquire_many(
                [runtime.state.session_id for runtime, _ in claimed], self.owner
            )
        finally:  # cancelled: nothing is adopted (the leases taken go with the daemon's presence)
            for runtime, stranded in claimed:
                session_id = runtime.state.session_id
                if session_id in taken:
                    self.folds.forget(session_id)
                    adopted.append(runtime)
                    continue
                if self.live.get(session_id) is runtime:
                    del self.live[session_id]
                if stranded is not None:
                    self.stranded[session_id] = stranded
                refused.append(runtime.state)
            self.changed()
        return adopted, refused

    async def lease_owner(self, session_id: str) -> str | None:
        """Who holds the session's lease now (None when nobody does or NATS cannot say)."""
        with contextlib.suppress(ApomeshError):
            return await self.leases.owner(session_id)
        return None

    async def lease_owners(self, session_ids: Sequence[str]) -> dict[str, str] | None:
        """Who holds each of these sessions' leases now (session -> a holder that is alive), or
        None when NATS cannot say."""
        with contextlib.suppress(ApomeshError):
            return await self.leases.owners(session_ids)
        return None

    def keep_stranded_lease_reads(self) -> None:
        """After a boot scan: of its one read of every lease, keep the stranded sessions' only (an
        operator's resume takes each back at the revision read, in one compare-and-set)."""
        self.leases.keep_reads(self.stranded.keys())

    async def lease_holders(self) -> dict[str, str] | None:
        """Every held lease (session -> holder) in one read, or None when NATS cannot say."""
        with contextlib.suppress(ApomeshError):
            return await self.leases.holders()
        return None

    async def check_owned_here(self, session_id: str) -> None:
        """Refuse a write for a session another daemon owns (``OwnedElsewhere``)."""
        if session_id in self.live:
            return
        holder = await self.lease_owner(session_id)
        if holder is not None and holder != self.owner:
            raise OwnedElsewhere(session_id, holder, self.owner_url(holder))

    async def open_writer(self, session_id: str) -> SessionRuntime:
        """The session's writer for an operator's command: the live one, else one adopted (lease
        taken, coordinator not started) over the stranded or logged state."""
        runtime = self.live.get(session_id)
        if runtime is not None:
            return runtime
        rec = self.stranded.get(session_id)
        state = rec.state if rec is not None else None
        if state is None:
            state = await self.fold_checkpoints.fold(self.log_adapter, session_id)
            if state.last_index < 0:
                raise NotFound(f"session {session_id}")
        if state.terminal:
            raise ApomeshError(f"session {session_id} has already ended ({state.status})")
        return await self.adopt(state, recovered=None, fresh_children=False, start=False)

    def strand(self, entry: Recoverable) -> None:
        """List a session this daemon does not drive on the recoverable list."""
        self.stranded[entry.session_id] = entry
        self.changed()

    async def end(self, runtime: SessionRuntime, ending: Ending) -> None:
        """A writer stops driving its session (its ``on_end``): book it as finished, stranded or
        lost to another writer, and give its lease back. A finished session whose completed
        record the store does not take (the replicated bucket out of reach) is booked all the
        same, the record written again once the store answers: before, the error escaped the
        session's task (logged as never retrieved) and its lease stayed held."""
        state = runtime.state
        session_id = state.session_id
        if ending.kind == "finished":
            # Its completed record is written before it leaves the live set, so a listing
            # never misses an ended session between the two.
            assert state.ended is not None
            try:
                await self.write_completed(state)
            except StoreUnavailable as exc:
                # Ended on the log all the same: the record only spares a boot scan a fold.
                # Written again once the store answers; the lease is given back meanwhile.
                self.log.warning(
                    "session %s ended; its completed record waits for the store: %s",
                    session_id,
                    exc,
                )
                self.spawn(self._write_completed_when_answering(state))
            finally:
                if self.live.get(session_id) is runtime:
                    del self.live[session_id]
                    self.folds.keep_ended(state)
                self.changed()
            runtime.deps.metrics.observe_session_end(
                state.ended.status, state.last_ts - state.started_ts
            )
            self.stranded.pop(session_id, None)
            self._readopted.pop(session_id, None)
            with contextlib.suppress(Exception):
                await self.leases.release(session_id, self.owner)
            for ref in state.agents:
                self.snapshots.forget(f"{session_id}/{ref}")
            return
        if self.live.get(session_id) is runtime:
            del self.live[session_id]
        self.changed()
        if ending.kind == "stranded":
            self.stranded[session_id] = Recoverable(
                session_id,
                state.goal,
                ending.reason,
                ending.category,
                state.side_effects,
                state.last_ts,
                state,
            )
            self.spawn(self.leases.release(session_id, self.owner))
            return
        # Another writer appended to the log, or NATS did not answer: what this writer holds
        # may be stale either way. Its last append lands (or not) before the log is read again.
        self.folds.forget(session_id)
        await runtime.retire()
        for ref in state.agents:
            self.snapshots.forget(f"{session_id}/{ref}")
        if self.closing():
            # Its lease lapses with this daemon's presence, or the hand-over to the live peers
            # gives it back; the next driver folds its log.
            self._left_winding_down.add(session_id)
            return
        if ending.kind == "unavailable":
            self.spawn(self._drive_when_answering(session_id))
            return
        if await self.lease_owner(session_id) == self.owner:
            if await self._drive_again(session_id):
                return
            with contextlib.suppress(Exception):
                await self.leases.release(session_id, self.owner)
            return
        # Driven by the lease holder elsewhere, or by nobody: the lease holder may be a writer
        # that stops on this one's append in turn. Read from the log here, and watched until a
        # live daemon drives it (``let_go``).
        with contextlib.suppress(Exception):
            await self.leases.release(session_id, self.owner)
        self.let_go(session_id)

    async def _drive_when_answering(self, session_id: str) -> None:
        """A session whose writer stopped because NATS did not answer: fold its log and drive
        it on under its lease (``recovered="auto"``, as after a worker loss: journaled effects
        served from the log, an intent without its result through the tool's probe), tried
        again with a growing pause while NATS still does not answer. Left alone once another
        writer drives it (an operator's command here, a peer that holds its lease)."""
        pause = UNAVAILABLE_PAUSE
        while True:
            await asyncio.sleep(pause)
            if session_id in self.live:
                return
            if self.closing():
                self._left_winding_down.add(session_id)  # see ``end``
                return
            try:
                adopted = await self._adopt_from_log(session_id)
            except (LogUnavailable, StoreUnavailable) as exc:
                self.log.info("session %s waits for NATS to drive it again: %s", session_id, exc)
                pause = min(pause * 2, UNAVAILABLE_PAUSE_MAX)
                continue
            except Exception as exc:
                self.log.error("session %s not driven again: %s", session_id, exc)
                return
            if adopted:
                self.log.warning("session %s is driven again from its log", session_id)
            return

    async def _adopt_from_log(self, session_id: str) -> bool:
        """Fold the session's log as it stands (from its fold checkpoint) and drive it on here
        under its lease, as after a worker loss (``recovered="auto"``, its own agent refs); False
        when there was nothing to do (it has ended, or a writer drives it here already)."""
        state = await self.fold_checkpoints.fold(self.log_adapter, session_id)
        if state.terminal or session_id in self.live:
            return False
        await self.adopt(state, recovered="auto", fresh_children=False)
        return True

    async def _drive_again(self, session_id: str) -> bool:
        """This daemon holds the lease, so the writer that appended in between was a stale one
        (a daemon thawed after its lease moved here, whose last append landed first): fold the
        log as it now stands and drive the session on, as a takeover does. A stale writer stops
        once it sees the lease or meets this writer's appends; past ``READOPT_LIMIT`` conflicts
        in a row the session is left to the log, as before."""
        tries = self._readopted.get(session_id, 0) + 1
        if tries > READOPT_LIMIT:
            self._readopted.pop(session_id, None)
            self.log.error(
                "session %s: its log was appended to by another writer %d times while this "
                "daemon held its lease; it is read from the log from now on",
                session_id,
                READOPT_LIMIT,
            )
            return False
        self._readopted[session_id] = tries
        await asyncio.sleep(READOPT_PAUSE * tries)  # the stale writer sees the lease meanwhile
        try:
            if not await self._adopt_from_log(session_id):
                return True
        except Exception as exc:
            self.log.error("session %s not driven again after a conflict: %s", session_id, exc)
            return False
        self.log.warning(
            "session %s: a stale writer appended to its log while this daemon held its lease; "
            "it is folded from the log again and driven on here",
            session_id,
        )
        return True

    async def drain(self, grace: float) -> int:
        """A graceful shutdown's first half: every driven session stops dispatching, its running
        dispatches stop at their next node boundary and it logs ``SessionSuspended`` (the next
        daemon resumes it by itself). Waits up to ``grace`` seconds; answers how many sessions
        did not stop in time (``stop_all`` cuts them off: a side effect in flight among them is
        an unknown outcome, recovered like a crash)."""
        runtimes = [r for r in self.live.values() if r.task is not None and not r.task.done()]
        for runtime in runtimes:
            await runtime.drain()
        tasks = [r.task for r in runtimes if r.task is not None]
        if not tasks:
            return 0
        _, pending = await asyncio.wait(tasks, timeout=grace)
        suspended = sum(r.state.cleanly_suspended for r in runtimes)
        self.log.info(
            "drain: %d of %d sessions suspended at a node boundary for the next daemon",
            suspended,
            len(tasks),
        )
        if pending:
            self.log.warning(
                "%d of %d sessions did not reach a node boundary within %.1f s; cut off",
                len(pending),
                len(tasks),
                grace,
            )
        return len(pending)

    async def hand_over(self, *, hold_cut_off: float) -> list[str]:
        """After ``drain``, for the live peers: this daemon stops driving every session. Those
        that logged ``SessionSuspended`` get their leases back at once, for a peer to adopt them
        with no unknown outcome; one cut off by the grace period (a side effect may still be in
        flight on its worker) keeps its lease ``hold_cut_off`` seconds more, as long as a lease
        outlives a crashed daemon, and a peer adopts it then (or once this daemon's presence
        record ages out, should it exit first), as does one whose writer stopped on a conflict
        or NATS not answering during the drain (``_left_winding_down``: not handed over, its
        lease stayed here while this daemon lived on drained). Answers their ids."""
        handed: list[str] = []
        driven = list(self.live.items())
        # All stopped at once, as at shutdown (``stop_all``), then each handed over.
        await asyncio.gather(*(runtime.stop() for _, runtime in driven), return_exceptions=True)
        for session_id, runtime in driven:
            if self.live.get(session_id) is not runtime:
                continue
            del self.live[session_id]
            self.folds.forget(session_id)
            for ref in runtime.state.agents:
                self.snapshots.forget(f"{session_id}/{ref}")
            if runtime.state.cleanly_suspended:
                with contextlib.suppress(Exception):
                    await self.leases.release(session_id, self.owner)
            else:
                self.spawn(self._release_later(session_id, hold_cut_off))
            handed.append(session_id)
        # Sessions whose writer stopped on a conflict or NATS not answering during the drain:
        # cut off like those above (a dispatch of theirs may still run), so released as late.
        for session_id in sorted(self._left_winding_down - set(handed)):
            if session_id not in self.live:
                self.spawn(self._release_later(session_id, hold_cut_off))
                handed.append(session_id)
        self._left_winding_down.clear()
        self.changed()
        return handed

    async def _release_later(self, session_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        if session_id not in self.live:
            with contextlib.suppress(Exception):
                await self.leases.release(session_id, self.owner)

    async def stop_all(self) -> None:
        """Daemon shutdown: stop every writer, all at once (a writer resending a step it was
        cut off in ends with that attempt: one after the other, thousands of them waited for
        NATS in turn); its leases lapse with its presence record (see ``Daemon.aclose``)."""
        await asyncio.gather(
            *(runtime.stop() for runtime in list(self.live.values())), return_exceptions=True
        )

    # --- leases ----------------------------------------------------------------------------------

    async def lease_position(self) -> int | None:
        """Where the leases are now (``watch_leases`` can follow from there), or None when NATS
        cannot say."""
        with contextlib.suppress(ApomeshError):
            return await self.leases.position()
        return None

    async def watch_leases(self, since: int | None = None) -> Callable[[], Awaitable[None]]:
        """Follow every lease change (nothing is renewed per session: the daemon's presence record
        keeps all its leases alive) from now on, or after ``since`` (a ``lease_position`` read
        before any session was adopted here), the run of this daemon's own takes since left out
        when nobody else changed a lease meanwhile; answers the function that stops following."""
        return await self.leases.watch(self._lease_changed, since=since, owner=self.owner)

    def _lease_changed(self, session_id: str, owner: str | None) -> None:
        runtime = self.live.get(session_id)
        if runtime is None or owner == self.owner:
            return
        # Taken by another owner (this daemon's record lapsed: a long outage, say), or deleted
        # under a live session: look at the lease as it is now (a change seen late is no proof)
        # before the writer is stopped or the lease taken again.
        self.spawn(self._check_lease(session_id, runtime))

    async def _check_lease(self, session_id: str, runtime: SessionRuntime) -> None:
        with contextlib.suppress(Exception):
            holder = await self.leases.owner(session_id)
            if self.live.get(session_id) is not runtime or holder == self.owner:
                return
            if holder is None:  # deleted, or its holder is gone: take it again
                if await self.leases.acquire(session_id, self.owner):
                    if self.live.get(session_id) is not runtime:
                        await self.leases.release(session_id, self.owner)  # it ended meanwhile
                    return
                holder = await self.leases.owner(session_id)
            if self.live.get(session_id) is runtime:
                # The session is driven there now: stop driving it here.
                message = (
                    f"the lease of session {session_id} is held by {holder or 'another owner'}"
                )
                runtime.superseded(AppendConflict(message), message)

    # --- completed records -----------------------------------------------------------------------

    async def write_completed(self, state: SessionState) -> None:
        await self.store.put_completed(state.session_id, _completed_record(state))

    async def _write_completed_when_answering(self, state: SessionState) -> None:
        """``write_completed`` again, every 1 s doubled up to 30 s, while the store does not
        answer; given up once the daemon winds down (the next boot scan books the session)."""
        pause = UNAVAILABLE_PAUSE
        while not self.closing():
            await asyncio.sleep(pause)
            try:
                await self.write_completed(state)
                return
            except StoreUnavailable:
                pause = min(pause * 2, UNAVAILABLE_PAUSE_MAX)

    async def write_completed_many(self, states: Sequence[SessionState]) -> None:
        """The completed records of many ended sessions (a boot scan's, by the ten thousand),
        ``COMPLETED_PER_WRITE`` to a write, the writes sent together (the store commits what
        waits together: one LMDB transaction; on an R3 state bucket one atomic batch per 1,000
        messages, its limit, which one write of them all went over)."""
        records = [("completed", state.session_id, _completed_record(state)) for state in states]
        await asyncio.gather(
            *(
                self.store.write_batch(records[first : first + COMPLETED_PER_WRITE])
                for first in range(0, len(records), COMPLETED_PER_WRITE)
            )
        )

    async def completed_records(self) -> list[CompletedRecord]:
        return [_completed_decoder.decode(v) for _, v in await self.store.list_completed()]


def _completed_record(state: SessionState) -> bytes:
    """An ended session's completed record, encoded."""
    assert state.ended is not None
    return msgspec.msgpack.encode(
        CompletedRecord(
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
    )
