"""Retention: removing ended sessions, one by one (``apomesh sessions purge ID``) or every one that
ended longer ago than ``[retention] ended_after`` (the daemon's sweep at boot and every hour, or
``apomesh sessions purge --ended-before``).

A purge removes everything the daemon keeps of a session: its subject on the log stream, its
snapshots, conversation segments, definitions and journal records, its fold checkpoint, the
``Idempotency-Key`` records that answer it (a retry after the purge starts a new session), and
last its completed-session record. The completed record goes last on purpose (in the one write
that deletes the session's records, after its log subject is purged): a purge cut short (a crash,
a lost connection) leaves it behind, so the session is still listed as ended and the next sweep
or the operator's next purge finishes the job; purging what is already gone is a no-op. A sweep
purges ``PURGE_TOGETHER`` sessions at a time: their log subjects concurrently, then their
records, a few sessions' to a write (``WRITE_RECORDS``), each session's in one. Only an ended
session (completed, failed or cancelled) is purged; a running, paused or recoverable one is
refused (``CommandRefused``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.core.errors import ApomeshError, CommandRefused, NotFound
from apomesh.core.ports import EventLog
from apomesh.core.state import fold
from apomesh.runtime.fold_checkpoints import CHECKPOINT_DB
from apomesh.runtime.progress import PROGRESS_EVERY, ProgressLog
from apomesh.runtime.registry import (
    IDEMPOTENCY_DB,
    CompletedRecord,
    IdempotencyRecord,
    SessionRegistry,
)

log = logging.getLogger("apomesh.daemon")

SESSION_DATABASES = ("snapshots", "segments", "defs", "journal")
"""The store databases whose keys start with ``<session_id>/`` (the session's agent keys)."""

PURGE_TOGETHER = 256
"""Sessions a sweep purges together: their log subjects concurrently, their records in a few
writes (one by one, a sweep of 20,000 expired sessions took 46 s)."""

PURGES_IN_FLIGHT = 64
"""Log subject purges a sweep has in flight at once: 256 at once timed out on a loaded machine,
16 at once were several times slower than 256."""

WRITE_RECORDS = 500
"""The most records a purge deletes in one write, unless one session has more (its records are
never split): a replicated store's deletes go in one JetStream atomic batch a write, which takes
at most 1,000 messages."""

SWEEP_EVERY = 3600.0
"""Seconds between two retention sweeps of a running daemon."""


class Retention:
    """Purges ended sessions from the log and the state store (see the module docstring)."""

    def __init__(
        self,
        *,
        log_adapter: EventLog,
        store: AsyncStore,
        registry: SessionRegistry,
        forget: Callable[[str], None] = lambda session_id: None,
        progress_every: float = PROGRESS_EVERY,
    ) -> None:
        self.log_adapter = log_adapter
        self.progress_every = progress_every
        self.store = store
        self.registry = registry
        self._forget = forget

    async def ended_at(self, session_id: str) -> float:
        """When the session ended (its completed record, else its log): ``NotFound`` for an
        unknown session, ``CommandRefused`` for one that has not ended."""
        if self.registry.writer(session_id) is not None or session_id in self.registry.stranded:
            raise CommandRefused(
                f"session {session_id} has not ended: only an ended session can be purged"
            )
        for record in await self.registry.completed_records():
            if record.session_id == session_id:
                return record.ended_at
        envelopes = await self.log_adapter.read(session_id, -1)
        if not envelopes:
            raise NotFound(f"session {session_id}")
        state = fold(envelopes, session_id)
        if not state.terminal:
            raise CommandRefused(
                f"session {session_id} is {state.status}: only an ended session can be purged"
            )
        return state.last_ts

    async def purge(self, session_id: str) -> None:
        """Remove an ended session's log subject and every record of it."""
        await self.ended_at(session_id)
        await self._remove([session_id])
        log.info("purged session %s", session_id)

    async def _remove(self, session_ids: list[str], progress: ProgressLog | None = None) -> None:
        """Purge ``session_ids`` ``PURGE_TOGETHER`` at a time: their log subjects purged
        concurrently, then their records deleted, each session's in one write with others' up to
        ``WRITE_RECORDS`` records (the completed records with them, so a purge cut short leaves
        each session listed as ended). A session whose log subject NATS did not purge keeps its
        records; the others go on, and the first such error is raised at the end. ``progress``
        is told after each group how many sessions are done of how many."""
        keys = await self._idempotency_keys(set(session_ids))
        gate = asyncio.Semaphore(PURGES_IN_FLIGHT)
        failed: list[ApomeshError] = []
        for first in range(0, len(session_ids), PURGE_TOGETHER):
            group = session_ids[first : first + PURGE_TOGETHER]
            errors = await asyncio.gather(*(self._purge_log(s, gate) for s in group))
            failed.extend(error for error in errors if error is not None)
            together = [s for s, error in zip(group, errors, strict=True) if error is None]
            found = iter(
                await self.store.scan_many(
                    [(db, f"{s}/") for s in together for db in SESSION_DATABASES]
                )
            )
            written: list[tuple[str, int]] = []
            deletes: list[tuple[str, str]] = []
            for session_id in together:
                records = [(IDEMPOTENCY_DB, key) for key in keys.get(session_id, ())]
                for db in SESSION_DATABASES:
                    records.extend((db, key) for key, _ in next(found))
                records.append((CHECKPOINT_DB, session_id))
                records.append(("completed", session_id))
                if deletes and len(deletes) + len(records) > WRITE_RECORDS:
                    await self._delete(deletes, written)
                    written, deletes = [], []
                written.append((session_id, len(records)))
                deletes.extend(records)
            await self._delete(deletes, written)
            if progress is not None:
                progress(first + len(group), len(session_ids))
        if progress is not None:
            progress.finish(len(session_ids))
        if failed:
            log.warning("%d ended sessions not purged yet: %s", len(failed), failed[0])
            raise failed[0]

    async def _purge_log(self, session_id: str, gate: asyncio.Semaphore) -> ApomeshError | None:
        """Purge the session's log subject; the error when NATS did not."""
        async with gate:
            try:
                await self.log_adapter.delete_session(session_id)
            except ApomeshError as exc:
                return exc
        return None

    async def _delete(
        self, deletes: list[tuple[str, str]], sessions: list[tuple[str, int]]
    ) -> None:
        """Delete the records of ``sessions`` (id, how many records) in one write."""
        if not deletes:
            return
        await self.store.write_batch([], deletes)
        for session_id, count in sessions:
            self._forget(session_id)
            log.debug("purged session %s (%d records)", session_id, count)

    async def _idempotency_keys(self, session_ids: set[str]) -> dict[str, list[str]]:
        """The ``Idempotency-Key`` records that answer these sessions, by session."""
        keys: dict[str, list[str]] = {}
        for key, value in await self.store.scan(IDEMPOTENCY_DB, ""):
            record = msgspec.msgpack.decode(value, type=IdempotencyRecord)
            if record.session_id in session_ids:
                keys.setdefault(record.session_id, []).append(key)
        return keys

    async def expired(self, ended_before: float) -> list[CompletedRecord]:
        """The ended sessions whose completed record says they ended before ``ended_before``
        (unix seconds), oldest first."""
        records = [
            r
            for r in await self.registry.completed_records()
            if r.ended_at < ended_before
            and self.registry.writer(r.session_id) is None
            and r.session_id not in self.registry.stranded
        ]
        return sorted(records, key=lambda r: r.ended_at)

    async def sweep(self, ended_before: float) -> list[str]:
        """Purge every session that ended before ``ended_before``; returns their ids. Says how
        many it purges, and how far it has come every ``progress_every`` seconds."""
        purged = [record.session_id for record in await self.expired(ended_before)]
        if not purged:
            return purged
        log.info("retention: purging %s sessions that ended past retention", f"{len(purged):,}")
        progress = ProgressLog(log, "retention", "sessions purged", every=self.progress_every)
        await self._remove(purged, progress)
        log.info("retention: %s ended sessions purged", f"{len(purged):,}")
        return purged
