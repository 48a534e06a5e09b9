"""The ports the runtime depends on, as Protocols: the event log, session leases, the state store.

Adapters (``apomesh.adapters``) implement them on NATS JetStream and LMDB; in-memory twins
implement them for fast unit tests. One contract test suite runs against both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import Protocol

from apomesh.core.envelope import Envelope


class EventLog(Protocol):
    """The append-only, per-session event log."""

    async def ensure(self) -> None:
        """Create or verify the streams."""

    async def append(self, session_id: str, envelopes: Sequence[Envelope]) -> None:
        """Append a step's events in order. Indexes must continue the session's log exactly;
        a retry never duplicates and never loses an event. Raises ``AppendConflict`` when another
        writer got there first and ``LogUnavailable`` when NATS cannot be reached."""

    async def read(self, session_id: str, after: int = -1) -> list[Envelope]:
        """Every envelope of the session with index > ``after``, in order (decoded whole)."""

    async def read_raw(self, session_id: str, after: int = -1) -> list[tuple[int, bytes]]:
        """The same as (index, bytes) pairs, undecoded."""

    async def last_index(self, session_id: str) -> int:
        """The index of the session's last event, or -1 when it has none."""

    def tail(self, session_id: str, after: int = -1) -> AsyncIterator[Envelope]:
        """Envelopes with index > ``after`` as they are appended, forever (the caller stops)."""

    async def list_sessions(self) -> list[str]:
        """Every session id with at least one log entry."""

    async def delete_session(self, session_id: str) -> None:
        """Remove every entry of the session (retention); a session with none is a no-op."""


class SessionLeases(Protocol):
    """Session ownership leases (``adapters.kv.LeaseTable``): one daemon drives a session at a
    time; a lease holds while its owner's presence record is renewed."""

    async def acquire(self, session_id: str, owner: str) -> bool:
        """Take the lease; True when ``owner`` now holds it (already held, or taken over from an
        owner that is not alive)."""

    async def acquire_many(self, session_ids: Sequence[str], owner: str) -> set[str]:
        """``acquire`` for many sessions at once; answers those ``owner`` now holds (one NATS
        could not answer for is left out)."""

    async def release(self, session_id: str, owner: str) -> bool:
        """Give the lease up if ``owner`` holds it; True when it was released."""

    async def owner(self, session_id: str) -> str | None:
        """Who holds the lease now (an owner that is alive), or None."""

    async def owners(self, session_ids: Sequence[str]) -> dict[str, str]:
        """``owner`` for many sessions at once: those whose lease an owner that is alive holds ->
        that owner."""

    async def holders(self) -> dict[str, str]:
        """Every session whose lease is held now -> its holder, read in one pass."""

    def keep_reads(self, session_ids: Collection[str]) -> None:
        """Of what ``holders`` and ``owners`` read (each lease's value and revision, which a later
        ``acquire`` of the session sets the lease at), keep only these sessions'."""

    async def position(self) -> int:
        """Where the leases are now, for a ``watch`` that starts from there."""

    async def watch(
        self,
        on_change: Callable[[str, str | None], None],
        *,
        since: int | None = None,
        owner: str | None = None,
    ) -> Callable[[], Awaitable[None]]:
        """Call ``on_change(session_id, owner or None)`` for every lease change from now on, or
        after ``since`` (a ``position``), less a run of ``owner``'s own takes this table made
        that every change since was; answers the function that stops watching."""


class StateStore(Protocol):
    """The daemon's local durable state (LMDB): snapshots, journal, completed-session index.

    Methods are synchronous; the runtime calls them off the event loop. Values are opaque bytes
    except where noted. Keys are strings; ``agent_key`` is ``"<session_id>/<agent_ref>"``.
    """

    def put_snapshot(self, agent_key: str, snapshot_id: int, data: bytes) -> None: ...

    def get_snapshot(self, agent_key: str, snapshot_id: int) -> bytes | None: ...

    def latest_snapshot(self, agent_key: str) -> tuple[int, bytes] | None:
        """The agent's snapshot with the highest id as (id, bytes), or None when it has none."""

    def delete_snapshots_before(self, agent_key: str, snapshot_id: int) -> int:
        """Delete the agent's snapshots with id < ``snapshot_id`` (compaction); returns how many."""

    def write_batch(
        self, puts: Sequence[tuple[str, str, bytes]], deletes: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Write several (database, key, value) records in one synced transaction."""

    def get(self, db: str, key: str) -> bytes | None: ...

    def scan(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        """Every (key, value) in ``db`` whose key starts with ``prefix``, in key order."""

    def scan_here(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        """``scan`` of what this host holds: a store written through to a replica answers from
        its local copy, which may miss or be older than what peers wrote since (for readers
        that check what they read, such as fold checkpoints)."""

    def put_journal(self, agent_key: str, call_key: str, record: bytes) -> None: ...

    def get_journal(self, agent_key: str, call_key: str) -> bytes | None: ...

    def put_completed(self, session_id: str, record: bytes) -> None: ...

    def get_completed(self, session_id: str) -> bytes | None: ...

    def list_completed(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...
