"""The daemon's durable local state on LMDB, the key layout every ``StateStore`` shares, and an
async facade.

``LmdbStore`` keeps agent snapshots, conversation segments, stored definitions, the tool-call
journal, the completed-session index, sessions' folded-state checkpoints and daemon metadata in named sub-databases of one LMDB
environment under the data dir. Every write is one transaction, synced to disk before it returns
(``sync=True``): a process killed mid-write leaves either the whole transaction or none of it, never
a half-written record. A full map surfaces as ``StoreFull`` naming the data dir and the
``[store] map_size`` setting; every other LMDB failure as ``StoreError``. The key helpers
(``snapshot_key``, ``journal_key``) are the layout the in-memory twin uses too, so callers can build
``write_batch`` records that either store understands, and ``StoreRecords`` holds the record
helpers every store shares on top of its ``write_batch``, ``get`` and ``scan``. ``AsyncStore`` runs any ``StateStore`` off
the event loop; its writes are group-committed by one writer thread (the writes that queue while
one transaction commits share the next, and its fsync). The environment's directory is private
(0700, refused when another user owns it) and its files 0600.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar

import anyio
import anyio.to_thread
import lmdb
import msgspec

from apomesh.adapters.private_files import PRIVATE_FILE_MODE, private_dir
from apomesh.core.errors import StoreError, StoreFull, StoreUnavailable
from apomesh.core.ports import StateStore

DATABASES: Final = (
    "snapshots",
    "segments",
    "defs",
    "journal",
    "completed",
    "meta",
    "idempotency",
    "checkpoints",
    "shapes",
)
"""The named sub-databases; ``write_batch``, ``get`` and ``scan`` accept exactly these."""

DEFAULT_MAP_SIZE: Final = 1 << 30
MAX_KEY_BYTES: Final = 511  # LMDB's compiled-in key limit; the in-memory twin enforces it too
MAX_SNAPSHOT_ID: Final = (1 << 64) - 1
_MAX_DBS: Final = 16  # room for later sub-databases without reopening old data dirs differently
_SEPARATOR: Final = "\x00"  # sorts before every printable byte, so "a" keys precede "a2" keys

_T = TypeVar("_T")

READ_THREADS: Final = 40
"""Threads of an ``AsyncStore`` reading at once from a store whose reads wait on the network (the
replicated store): a takeover resumes many agents, each with a read of its snapshot."""
LMDB_READ_THREADS: Final = 4
"""The same for an ``LmdbStore``, whose reads take microseconds: a few threads serve a burst, and
a restart does not start a thread for each agent it resumes at once."""


def _check_agent_key(agent_key: str) -> None:
    if not agent_key or _SEPARATOR in agent_key:
        raise StoreError(f"agent key {agent_key!r} must be non-empty and hold no NUL character")


def snapshot_key(agent_key: str, snapshot_id: int) -> str:
    """The ``snapshots`` key of one snapshot; fixed-width hex so key order is id order."""
    _check_agent_key(agent_key)
    if not 0 <= snapshot_id <= MAX_SNAPSHOT_ID:
        raise StoreError(f"snapshot id {snapshot_id} is outside 0..2**64-1")
    return f"{agent_key}{_SEPARATOR}{snapshot_id:016x}"


def snapshot_prefix(agent_key: str) -> str:
    """The prefix every ``snapshots`` key of one agent starts with (and no other agent's does)."""
    _check_agent_key(agent_key)
    return agent_key + _SEPARATOR


def parse_snapshot_key(key: str) -> tuple[str, int]:
    """The (agent_key, snapshot_id) a ``snapshot_key`` was built from."""
    agent_key, separator, hex_id = key.rpartition(_SEPARATOR)
    if not separator or len(hex_id) != 16:
        raise StoreError(f"{key!r} is not a snapshot key")
    return agent_key, int(hex_id, 16)


def journal_key(agent_key: str, call_key: str) -> str:
    """The ``journal`` key of one tool call, scoped by the agent that made it."""
    _check_agent_key(agent_key)
    if not call_key:
        raise StoreError("a journal call key must not be empty")
    return f"{agent_key}{_SEPARATOR}{call_key}"


def journal_prefix(agent_key: str) -> str:
    """The prefix of every ``journal`` key of one agent."""
    _check_agent_key(agent_key)
    return agent_key + _SEPARATOR


def encode_key(key: str) -> bytes:
    """A store key as the UTF-8 bytes LMDB orders (the same order as ``str`` comparison)."""
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise StoreError(f"key {key!r} is not valid UTF-8 text: {exc}") from None
    if not raw:
        raise StoreError("a store key must not be empty")
    if len(raw) > MAX_KEY_BYTES:
        raise StoreError(f"key {key[:40]!r}... is {len(raw)} bytes, over LMDB's {MAX_KEY_BYTES}")
    return raw


def check_database(db: str) -> str:
    if db not in DATABASES:
        raise StoreError(f"unknown store database {db!r}; expected one of {', '.join(DATABASES)}")
    return db


class StoreUsage(msgspec.Struct, frozen=True):
    """How full the LMDB map is, for metrics and an early warning before ``StoreFull``."""

    used_bytes: int
    map_size: int


class StoreRecords:
    """The record helpers every ``StateStore`` shares (snapshots, journal copies, the completed
    index), written once on top of the store's own ``write_batch``, ``get`` and ``scan``."""

    def write_batch(
        self, puts: Sequence[tuple[str, str, bytes]], deletes: Sequence[tuple[str, str]] = ()
    ) -> None:
        raise NotImplementedError

    def get(self, db: str, key: str) -> bytes | None:
        raise NotImplementedError

    def scan(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        raise NotImplementedError

    def scan_here(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        """``scan`` of what this host holds: all of it, for a store with no replica."""
        return self.scan(db, prefix)

    def put_snapshot(self, agent_key: str, snapshot_id: int, data: bytes) -> None:
        self.write_batch([("snapshots", snapshot_key(agent_key, snapshot_id), data)])

    def get_snapshot(self, agent_key: str, snapshot_id: int) -> bytes | None:
        return self.get("snapshots", snapshot_key(agent_key, snapshot_id))

    def latest_snapshot(self, agent_key: str) -> tuple[int, bytes] | None:
        """The agent's snapshot with the highest id as (id, bytes), or None when it has none."""
        found = self.scan("snapshots", snapshot_prefix(agent_key))
        return (parse_snapshot_key(found[-1][0])[1], found[-1][1]) if found else None

    def put_journal(self, agent_key: str, call_key: str, record: bytes) -> None:
        self.write_batch([("journal", journal_key(agent_key, call_key), record)])

    def get_journal(self, agent_key: str, call_key: str) -> bytes | None:
        return self.get("journal", journal_key(agent_key, call_key))

    def put_completed(self, session_id: str, record: bytes) -> None:
        self.write_batch([("completed", session_id, record)])

    def get_completed(self, session_id: str) -> bytes | None:
        return self.get("completed", session_id)

    def list_completed(self) -> list[tuple[str, bytes]]:
        return self.scan("completed", "")


class LmdbStore(StoreRecords):
    """``StateStore`` on one LMDB environment in the directory ``path`` (created if missing).

    ``map_size`` caps the data on disk (LMDB maps it up front; the file grows only as written).
    ``sync=False`` trades durability against power loss for commit speed; a killed process still
    loses nothing committed. Safe to call from many threads: each call opens its own transaction,
    and LMDB's write lock serialises writers.
    """

    def __init__(self, path: Path, map_size: int = DEFAULT_MAP_SIZE, sync: bool = True) -> None:
        self.path = Path(path)
        self.map_size = map_size
        self.sync = sync
        try:
            private_dir(self.path)
            self._env: lmdb.Environment | None = lmdb.open(
                str(self.path),
                map_size=map_size,
                max_dbs=_MAX_DBS,
                sync=sync,
                metasync=sync,
                lock=True,
                subdir=True,
                mode=PRIVATE_FILE_MODE,
            )
            for name in ("data.mdb", "lock.mdb"):  # files an older start made 0644
                os.chmod(self.path / name, PRIVATE_FILE_MODE)
            with self._env.begin(write=True) as txn:
                self._dbs = {
                    name: self._env.open_db(name.encode(), txn=txn, create=True)
                    for name in DATABASES
                }
        except lmdb.Error as exc:
            raise StoreError(f"cannot open the LMDB store at {self.path}: {exc}") from exc
        except OSError as exc:
            raise StoreError(f"cannot create the LMDB store dir {self.path}: {exc}") from exc

    # -- plumbing ---------------------------------------------------------------------------------

    def _environment(self) -> lmdb.Environment:
        if self._env is None:
            raise StoreError(f"the LMDB store at {self.path} is closed")
        return self._env

    @contextlib.contextmanager
    def _translated(self, action: str) -> Iterator[None]:
        try:
            yield
        except lmdb.MapFullError as exc:
            raise StoreFull(
                f"the LMDB store at {self.path} is full while trying to {action}: its map_size is "
                f"{self.map_size} bytes. Nothing committed was lost; raise `map_size` in the [store] "
                f"section of the config (or APOMESH_STORE_MAP_SIZE) and restart the daemon"
            ) from exc
        except lmdb.Error as exc:
            raise StoreError(f"the LMDB store at {self.path} failed to {action}: {exc}") from exc

    def _read(self, action: str, body: Callable[[lmdb.Transaction], _T]) -> _T:
        env = self._environment()
        with self._translated(action), env.begin(buffers=False) as txn:
            return body(txn)

    def _write(self, action: str, body: Callable[[lmdb.Transaction], _T]) -> _T:
        env = self._environment()
        # The context manager aborts on any exception, so a failed batch leaves nothing behind.
        with self._translated(action), env.begin(write=True) as txn:
            return body(txn)

    # -- generic records --------------------------------------------------------------------------

    def write_batch(
        self, puts: Sequence[tuple[str, str, bytes]], deletes: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Write the (database, key, value) ``puts`` and then remove the (database, key)
        ``deletes``, all in one synced transaction: after a crash either all of it is there or
        none of it."""
        encoded_puts = [
            (self._dbs[check_database(db)], encode_key(key), bytes(value))
            for db, key, value in puts
        ]
        encoded_deletes = [(self._dbs[check_database(db)], encode_key(key)) for db, key in deletes]
        if not encoded_puts and not encoded_deletes:
            return

        def body(txn: lmdb.Transaction) -> None:
            for handle, key, value in encoded_puts:
                txn.put(key, value, db=handle)
            for handle, key in encoded_deletes:
                txn.delete(key, db=handle)

        self._write(f"write {len(encoded_puts)} records", body)

    def write_batches(
        self, batches: Sequence[tuple[Sequence[tuple[str, str, bytes]], Sequence[tuple[str, str]]]]
    ) -> None:
        """Several ``write_batch`` calls' (puts, deletes), applied in order in one synced
        transaction: one fsync for all of them, and after a crash all of them or none."""
        encoded = [
            (
                [
                    (self._dbs[check_database(db)], encode_key(key), bytes(value))
                    for db, key, value in puts
                ],
                [(self._dbs[check_database(db)], encode_key(key)) for db, key in deletes],
            )
            for puts, deletes in batches
        ]

        def body(txn: lmdb.Transaction) -> None:
            for encoded_puts, encoded_deletes in encoded:
                for handle, key, value in encoded_puts:
                    txn.put(key, value, db=handle)
                for handle, key in encoded_deletes:
                    txn.delete(key, db=handle)

        self._write(f"write {len(encoded)} batches", body)

    def get(self, db: str, key: str) -> bytes | None:
        handle = self._dbs[check_database(db)]
        raw_key = encode_key(key)

        def body(txn: lmdb.Transaction) -> bytes | None:
            value = txn.get(raw_key, db=handle)
            return None if value is None else bytes(value)

        return self._read(f"read {db}", body)

    def scan(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        """Every (key, value) in ``db`` whose key starts with ``prefix``, in key order."""
        handle = self._dbs[check_database(db)]
        raw_prefix = encode_key(prefix) if prefix else b""

        def body(txn: lmdb.Transaction) -> list[tuple[str, bytes]]:
            found: list[tuple[str, bytes]] = []
            cursor = txn.cursor(db=handle)
            positioned = cursor.set_range(raw_prefix) if raw_prefix else cursor.first()
            if not positioned:
                return found
            for raw_key, value in cursor.iternext():
                key = bytes(raw_key)
                if not key.startswith(raw_prefix):
                    break
                found.append((key.decode("utf-8"), bytes(value)))
            return found

        return self._read(f"scan {db}", body)

    # -- snapshots --------------------------------------------------------------------------------

    def latest_snapshot(self, agent_key: str) -> tuple[int, bytes] | None:
        """The agent's snapshot with the highest id as (id, bytes), or None when it has none."""
        prefix = snapshot_prefix(agent_key).encode("utf-8")
        # The first key past every one of this agent's keys; the entry before it is the latest.
        after_prefix = prefix[:-1] + b"\x01"
        handle = self._dbs["snapshots"]

        def body(txn: lmdb.Transaction) -> tuple[int, bytes] | None:
            cursor = txn.cursor(db=handle)
            found = cursor.prev() if cursor.set_range(after_prefix) else cursor.last()
            key = bytes(cursor.key())
            if not found or not key.startswith(prefix):
                return None
            _, snapshot_id = parse_snapshot_key(key.decode("utf-8"))
            return snapshot_id, bytes(cursor.value())

        return self._read("read the latest snapshot", body)

    def delete_snapshots_before(self, agent_key: str, snapshot_id: int) -> int:
        """Delete the agent's snapshots with id < ``snapshot_id``; returns how many went."""
        start = snapshot_prefix(agent_key).encode("utf-8")
        end = snapshot_key(agent_key, snapshot_id).encode("utf-8")
        handle = self._dbs["snapshots"]

        def body(txn: lmdb.Transaction) -> int:
            cursor = txn.cursor(db=handle)
            deleted = 0
            positioned = cursor.set_range(start)
            while positioned and bytes(cursor.key()) < end:
                cursor.delete()  # moves the cursor to the next entry
                deleted += 1
                positioned = bytes(cursor.key()) != b""
            return deleted

        return self._write("delete old snapshots", body)

    # -- lifecycle --------------------------------------------------------------------------------

    def usage(self) -> StoreUsage:
        """Bytes in use (pages up to the last one written) against the map size."""
        env = self._environment()
        with self._translated("read its usage"):
            info = env.info()
            page_size = env.stat()["psize"]
        return StoreUsage(used_bytes=(info["last_pgno"] + 1) * page_size, map_size=info["map_size"])

    def close(self) -> None:
        """Close the environment; later calls raise ``StoreError``. Closing twice is harmless."""
        env, self._env = self._env, None
        if env is not None:
            env.close()

    def __enter__(self) -> LmdbStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class _QueuedWrite:
    """One caller's ``write_batch`` waiting for the group commit that carries it."""

    __slots__ = ("abandoned", "deletes", "error", "future", "puts")

    def __init__(
        self,
        puts: Sequence[tuple[str, str, bytes]],
        deletes: Sequence[tuple[str, str]],
        future: asyncio.Future[None],
    ) -> None:
        self.puts = puts
        self.deletes = deletes
        self.future = future
        self.error: BaseException | None = None
        self.abandoned = False  # its caller was cancelled before the writer took it


class _GroupWriter:
    """The thread that commits queued writes: what is queued while it commits one group goes in
    the next, which it starts at once (never waiting for the event loop to come round), and it
    wakes each group's callers with one call into their loop.

    A group takes every write waiting when it starts. py-lmdb lets go of the GIL around every
    put and around the fsync, so a commit that runs while the event loop runs other sessions'
    steps waits for the GIL once per record; one that takes them all runs while the loop waits
    for it. Measured on the standard workload (``docs/performance.md``): groups of half of what
    waited, which kept the sessions out of lockstep, left this thread busy 85 % of the time,
    committing a group of six in 2.0-2.4 ms where a group of twenty now takes 1.1-1.6 ms (1.35-1.41x
    the naive loop's steps/s instead of 1.12-1.20x at JetStream's default sync; 0.92-1.00x
    instead of 1.00-1.09x at ``sync_interval: always``, where a step waits on the server's fsync
    of each append).
    """

    def __init__(self, commit: Callable[[list[_QueuedWrite]], None]) -> None:
        self._commit = commit
        self._queue: queue.SimpleQueue[_QueuedWrite | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="apomesh-store-writer", daemon=True)
        self._thread.start()

    def submit(self, entry: _QueuedWrite) -> None:
        self._queue.put(entry)

    def stop(self) -> None:
        """Commit what is queued, then end the thread (blocks until it has)."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            group: list[_QueuedWrite] = []
            item = self._queue.get()
            while True:
                if item is None:
                    stopping = True
                elif not item.abandoned:
                    group.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if not group:
                continue
            try:
                self._commit(group)
            except BaseException as exc:  # never leave a caller waiting
                for entry in group:
                    entry.error = entry.error or exc
            loops: dict[asyncio.AbstractEventLoop, list[_QueuedWrite]] = {}
            for entry in group:
                loops.setdefault(entry.future.get_loop(), []).append(entry)
            for loop, entries in loops.items():
                with contextlib.suppress(RuntimeError):  # a loop closed meanwhile: nobody waits
                    loop.call_soon_threadsafe(_settle, entries)


def _settle(entries: list[_QueuedWrite]) -> None:
    for entry in entries:
        if entry.future.done():  # its caller was cancelled while the write ran
            continue
        if entry.error is not None:
            entry.future.set_exception(entry.error)
        else:
            entry.future.set_result(None)


class AsyncStore:
    """Any ``StateStore`` called from async code: each call runs in a worker thread.

    Reads run concurrently on the store's reader threads (``LMDB_READ_THREADS`` or
    ``READ_THREADS``, in an executor of asyncio's: a daemon's start loads no other thread
    machinery for them). Writes are group-committed by one
    writer thread: writes that arrive while it commits a transaction go in the next ones together
    (``write_batches`` when the store has it), all of those waiting a group
    (``_GroupWriter``), so a burst of writes from many sessions costs a few fsyncs instead of one
    per write, and never parks a thread per write on LMDB's write lock. Each caller's batch is still all-or-nothing and durable when its call
    returns; if a group's transaction fails, its batches are retried one by one so one bad batch
    fails only its caller. A cancelled caller whose batch the writer has not taken yet takes it
    back; one already being committed still finishes (never half-applied). A group that fails
    with ``StoreUnavailable`` (the replicated tier out of reach) fails all its callers at once.
    Outside asyncio (the writer wakes callers through their asyncio loop) each write is its own
    transaction.
    """

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._write_limiter: anyio.CapacityLimiter | None = None
        self._writer: _GroupWriter | None = None
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        self._read_threads = LMDB_READ_THREADS if isinstance(store, LmdbStore) else READ_THREADS

    async def _read(self, call: Callable[..., _T], *args: Any) -> _T:
        """``call(*args)`` in a reader thread."""
        if self._readers is None:
            self._readers = concurrent.futures.ThreadPoolExecutor(
                self._read_threads, thread_name_prefix="apomesh-store-reader"
            )
        return await asyncio.get_running_loop().run_in_executor(self._readers, call, *args)

    def _writes(self) -> anyio.CapacityLimiter:
        # Created on first use so the facade can be built outside a running event loop.
        if self._write_limiter is None:
            self._write_limiter = anyio.CapacityLimiter(1)
        return self._write_limiter

    async def _group_write(
        self, puts: Sequence[tuple[str, str, bytes]], deletes: Sequence[tuple[str, str]] = ()
    ) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            await anyio.to_thread.run_sync(
                self.store.write_batch, puts, deletes, limiter=self._writes()
            )
            return
        if self._writer is None:
            self._writer = _GroupWriter(self._commit_group)
        entry = _QueuedWrite(puts, deletes, loop.create_future())
        self._writer.submit(entry)
        try:
            await entry.future
        except asyncio.CancelledError:
            entry.abandoned = True
            raise

    def _commit_group(self, group: list[_QueuedWrite]) -> None:
        """Runs in the writer thread: the group in one transaction when the store can."""
        write_batches = getattr(self.store, "write_batches", None)
        if len(group) > 1 and write_batches is not None:
            try:
                write_batches([(entry.puts, entry.deletes) for entry in group])
            except StoreUnavailable as exc:
                # The replicated tier is out of reach: each batch alone would wait as long.
                for entry in group:
                    entry.error = exc
                return
            except Exception:
                pass  # apply them one by one below, so the error reaches only its own caller
            else:
                return
        for entry in group:
            try:
                self.store.write_batch(entry.puts, entry.deletes)
            except Exception as exc:
                entry.error = exc

    async def put_snapshot(self, agent_key: str, snapshot_id: int, data: bytes) -> None:
        await self._group_write([("snapshots", snapshot_key(agent_key, snapshot_id), data)])

    async def get_snapshot(self, agent_key: str, snapshot_id: int) -> bytes | None:
        return await self._read(self.store.get_snapshot, agent_key, snapshot_id)

    async def latest_snapshot(self, agent_key: str) -> tuple[int, bytes] | None:
        return await self._read(self.store.latest_snapshot, agent_key)

    async def delete_snapshots_before(self, agent_key: str, snapshot_id: int) -> int:
        return await anyio.to_thread.run_sync(
            self.store.delete_snapshots_before, agent_key, snapshot_id, limiter=self._writes()
        )

    async def write_batch(
        self, puts: Sequence[tuple[str, str, bytes]], deletes: Sequence[tuple[str, str]] = ()
    ) -> None:
        await self._group_write(puts, deletes)

    async def get(self, db: str, key: str) -> bytes | None:
        return await self._read(self.store.get, db, key)

    async def scan(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        return await self._read(self.store.scan, db, prefix)

    async def scan_here(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        return await self._read(self.store.scan_here, db, prefix)

    async def scan_many(self, wanted: Sequence[tuple[str, str]]) -> list[list[tuple[str, bytes]]]:
        """``scan`` for each (database, prefix) in ``wanted``, in one trip to a worker thread
        (a purge of thousands of sessions scans four databases each)."""

        def scan_all() -> list[list[tuple[str, bytes]]]:
            return [self.store.scan(db, prefix) for db, prefix in wanted]

        return await self._read(scan_all)

    async def put_journal(self, agent_key: str, call_key: str, record: bytes) -> None:
        await self._group_write([("journal", journal_key(agent_key, call_key), record)])

    async def get_journal(self, agent_key: str, call_key: str) -> bytes | None:
        return await self._read(self.store.get_journal, agent_key, call_key)

    async def put_completed(self, session_id: str, record: bytes) -> None:
        await self._group_write([("completed", session_id, record)])

    async def get_completed(self, session_id: str) -> bytes | None:
        return await self._read(self.store.get_completed, session_id)

    async def list_completed(self) -> list[tuple[str, bytes]]:
        return await self._read(self.store.list_completed)

    async def aclose(self) -> None:
        """Close the wrapped store after every queued write has run."""
        writer, self._writer = self._writer, None
        if writer is not None:
            await anyio.to_thread.run_sync(writer.stop)
        readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=False)
        await anyio.to_thread.run_sync(self.store.close, limiter=self._writes())

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
