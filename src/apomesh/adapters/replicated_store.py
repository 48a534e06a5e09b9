"""The state store of a cluster deployment: LMDB on the host, a replicated JetStream KV bucket
behind it, so the records recovery reads survive the loss of the daemon's host.

``ReplicatedStore`` implements the ``StateStore`` port over an ``LmdbStore`` (the local store and
cache) and a ``StateReplica`` (the KV bucket ``APOMESH_STATE``, with as many replicas as the log
stream). Every database but ``meta`` (the daemon's own identity) is replicated: snapshot records
(recorded model turns among them), conversation segments, definitions, the tool-call journal copy
and the completed-session index.

- A write goes to the bucket first, then to LMDB in one synced transaction. It returns only
  when both are durable; a bucket that cannot be reached or does not confirm within ``timeout``
  seconds (the write is sent again meanwhile, so a reconnect or a leader election is ridden out)
  is ``StoreUnavailable`` and LMDB is not touched. On a replicated bucket (R3) the write is one
  JetStream atomic batch (every message of a ``write_batch``, or of a group-committed
  ``write_batches``, published without waiting, the commit's acknowledgement covering them all:
  one round trip, all or nothing). On an R1 bucket, where nats-server stages every atomic batch
  in a file store of its own, a write's whole values go as plain publishes, sent at once and
  each acknowledged, and its split values and deletes (KV delete markers: compaction, retention)
  follow in atomic batches (``StateReplica.write``). A write cut off part way there leaves some
  of its whole values and nothing else, which is safe because every record the store holds is
  either true on its own (a definition, a journal copy of what the log holds, a completed
  record) or reached only through the log: a dispatch continues from the snapshot its log's
  pointer names and drops later snapshots and segments (``SnapshotStore.load_logged``), and a
  compaction's merged segment beside the small ones it replaces is read once
  (``runtime/snapshots.py``).
- The bucket is the authority, LMDB the host's copy: a peer taking a session over has nothing of
  it in its LMDB, and a daemon given a session back may hold an older copy than the peer left (a
  snapshot id is written again once an unlogged snapshot is dropped, a compacted segment is
  trimmed, a journal copy goes from intent to result). So listings (``scan``,
  ``latest_snapshot``, ``list_completed``, ``delete_snapshots_before``) and point reads ask the
  bucket, and what they bring that LMDB lacks is copied into it; only records that never change
  once written (the completed index) are read from LMDB first, falling through to the bucket on
  a miss.

A value larger than one NATS message (``max_payload`` less room for the subject and headers) is
split: the main key's value starts with a one-byte frame tag (``0`` whole, ``1`` split, then the
part count) and the further parts live under ``_parts.<key>.<n>``, written with it in one atomic
batch. KV keys keep the store's order: ``<db>.<head>[.<tail>]``, the store key split at its first
NUL (the agent key, then the snapshot id, segment number or call key), each token ``_`` and the
key's reversible KV encoding, so one agent's records are one subject filter.

The port is synchronous (the runtime calls it from worker threads), so the bucket is driven on an
event loop of its own, in a thread, over a NATS connection of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
import uuid
from collections.abc import Awaitable, Coroutine, Sequence
from types import TracebackType
from typing import Any, Final, TypeVar

import msgspec
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType

from apomesh.adapters import kv
from apomesh.adapters.lmdb_store import (
    LmdbStore,
    StoreRecords,
    check_database,
    encode_key,
    snapshot_key,
    snapshot_prefix,
)
from apomesh.adapters.nats_connect import (
    NATS,
    UNAVAILABLE_ERRORS,
    close_quietly,
    connect,
    direct_get_pages,
    read_pub_ack,
    request_many,
)
from apomesh.core.errors import LogError, LogUnavailable, StoreError, StoreUnavailable

__all__ = [
    "LOCAL_DATABASES",
    "STATE_BUCKET",
    "ReplicatedStore",
    "StateReplica",
]

log = logging.getLogger("apomesh.store")

STATE_BUCKET: Final = "APOMESH_STATE"
LOCAL_DATABASES: Final = frozenset({"meta"})
"""Databases that stay on the host: the daemon's own identity is no peer's business."""
WRITE_ONCE_DATABASES: Final = frozenset({"completed", "shapes"})
"""Replicated databases whose records never change once written: LMDB answers them first."""
ATOMIC_BATCH_LIMIT: Final = 1000
"""The most messages nats-server takes in one atomic batch (commit included)."""
DEFAULT_TIMEOUT: Final = 5.0
_SUBJECT_PREFIX: Final = f"$KV.{STATE_BUCKET}."
_STREAM: Final = f"KV_{STATE_BUCKET}"
_PARTS: Final = "_parts"
_ROOM: Final = 16 * 1024  # of max_payload, for the subject, the batch and KV headers
_WHOLE: Final = b"\x00"
_SPLIT: Final = b"\x01"
_READ_PAGE: Final = 256
_DELETE_SLICE: Final = 500
_ATTEMPT_TIMEOUT: Final = 2.0  # one commit's wait for its acknowledgement before it is sent again

_NOT_NOW: Final[tuple[type[BaseException], ...]] = (*UNAVAILABLE_ERRORS, LogUnavailable)
"""What a write sent while NATS reconnects or a stream elects its leader meets: sent again."""

_T = TypeVar("_T")

Puts = Sequence[tuple[str, str, bytes]]
Deletes = Sequence[tuple[str, str]]


def _token(text: str) -> str:
    return "_" + (kv.encode_key(text) if text else "")


def kv_key(db: str, key: str) -> str:
    """The bucket key of store record (``db``, ``key``)."""
    head, separator, tail = key.partition("\x00")
    return f"{db}.{_token(head)}" + (f".{_token(tail)}" if separator else "")


def _store_key(kvkey: str) -> tuple[str, str]:
    db, _, rest = kvkey.partition(".")
    head, separator, tail = rest.partition(".")
    key = kv.decode_key(head[1:]) + (("\x00" + kv.decode_key(tail[1:])) if separator else "")
    return db, key


def _filter(db: str, prefix: str) -> str:
    """The narrowest subject filter holding every key of ``db`` that starts with ``prefix``."""
    head, separator, tail = prefix.partition("\x00")
    if separator and not tail:
        return f"{_SUBJECT_PREFIX}{db}.{_token(head)}.>"
    return f"{_SUBJECT_PREFIX}{db}.>"


def _part_subject(kvkey: str, number: int) -> str:
    return f"{_SUBJECT_PREFIX}{_PARTS}.{kvkey}.{number}"


def _deleted(headers: dict[str, str] | None) -> bool:
    """Whether a message with these headers is a KV delete or purge marker."""
    return (headers or {}).get("KV-Operation") in ("DEL", "PURGE")


class _Message(msgspec.Struct, frozen=True):
    subject: str
    data: bytes
    headers: dict[str, str] | None = None


class StateReplica:
    """The ``APOMESH_STATE`` bucket, async: atomic batch writes, point reads, listings."""

    def __init__(self, nc: NATS, *, replicas: int = 1, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._nc = nc
        self._js = nc.jetstream(timeout=timeout)
        self.timeout = timeout
        self.chunk = max(4096, int(nc.max_payload) - _ROOM)
        self.publish_whole = replicas == 1
        """Whole values go as plain publishes, not in atomic batches (``write``): on an R1
        bucket nats-server stages each atomic batch in a file store of its own."""

    @classmethod
    async def open(
        cls, nc: NATS, replicas: int = 1, *, timeout: float = DEFAULT_TIMEOUT
    ) -> StateReplica:
        """Create or reconcile the bucket (``replicas`` copies, atomic batches allowed)."""
        replica = cls(nc, replicas=replicas, timeout=timeout)
        await kv.open_bucket(
            replica._js,
            KeyValueConfig(
                bucket=STATE_BUCKET,
                description="apomesh state store: snapshots, segments, definitions, journal copy",
                history=1,
                replicas=replicas,
                storage=StorageType.FILE,
                direct=True,
            ),
            allow_atomic=True,
        )
        return replica

    async def purge(self) -> None:
        """Remove every record (tests and a deliberate reset only)."""
        with _unavailable("purge"):
            await self._js.purge_stream(_STREAM)

    # -- values and their parts -------------------------------------------------------------------

    def part_count(self, size: int) -> int:
        """How many messages a value of ``size`` bytes takes."""
        if size + 1 <= self.chunk:
            return 1
        rest = size - (self.chunk - 5)
        return 1 + -(-rest // self.chunk)

    def _messages(self, db: str, key: str, value: bytes) -> list[_Message]:
        kvkey = kv_key(db, key)
        count = self.part_count(len(value))
        if count == 1:
            return [_Message(_SUBJECT_PREFIX + kvkey, _WHOLE + value)]
        first = self.chunk - 5
        messages = [
            _Message(_SUBJECT_PREFIX + kvkey, _SPLIT + count.to_bytes(4, "big") + value[:first])
        ]
        for number in range(1, count):
            start = first + (number - 1) * self.chunk
            messages.append(
                _Message(_part_subject(kvkey, number), value[start : start + self.chunk])
            )
        return messages

    async def _whole(self, kvkey: str, stored: bytes) -> bytes:
        """The value a main message's bytes stand for, fetching its further parts."""
        if stored[:1] == _WHOLE:
            return stored[1:]
        if stored[:1] != _SPLIT or len(stored) < 5:
            raise StoreError(f"replicated record {kvkey} is not a framed value")
        count = int.from_bytes(stored[1:5], "big")
        parts = await asyncio.gather(
            *(self._last(_part_subject(kvkey, number)) for number in range(1, count))
        )
        if any(part is None for part in parts):
            raise StoreError(f"replicated record {kvkey} is missing one of its {count} parts")
        return stored[5:] + b"".join(part for part in parts if part is not None)

    @staticmethod
    def stored_parts(stored: bytes) -> int:
        """How many messages the value whose main message is ``stored`` takes."""
        return int.from_bytes(stored[1:5], "big") if stored[:1] == _SPLIT else 1

    async def _last(self, subject: str) -> bytes | None:
        try:
            msg = await self._js.get_msg(_STREAM, subject=subject, direct=True)
        except nats.js.errors.NotFoundError:
            return None
        return None if _deleted(msg.headers) else msg.data or b""

    # -- writes -----------------------------------------------------------------------------------

    async def write(self, batches: Sequence[tuple[Puts, Sequence[tuple[str, str, int]]]]) -> None:
        """Write every (puts, deletes) batch; a delete is (db, key, parts the stored value takes).
        The bucket then holds what LMDB holds after the same batches in one transaction: each
        record takes its last operation (put, then deleted: deleted; deleted, then put: put).
        Raises ``StoreUnavailable`` when the bucket does not confirm.

        On a replicated bucket (R3) everything goes in atomic batches, each caller's batch in one
        (nats-server stages a batch in memory and replicates it as one proposal): all or nothing.
        On an R1 bucket (one nats-server) it stages each atomic batch in a file store of its own
        (directories made, files written, synced and removed: 3-4 ms a batch, one batch at a time
        across the stream), so whole values go first as plain publishes, sent at once and each
        acknowledged (0.3-0.6 ms), and split values and deletes follow in atomic batches once
        every whole value is acknowledged: a value is never read without one of its parts, and a
        batch's deletes land all or none. A write cut off part way there leaves some of its whole
        values and nothing else, which every reader allows for (the module docstring)."""
        final: dict[str, tuple[int, str, str, bytes | None, int]] = {}
        for number, (puts, deletes) in enumerate(batches):
            for db, key, value in puts:
                final[kv_key(db, key)] = (number, db, key, value, 0)
            for db, key, parts in deletes:
                final[kv_key(db, key)] = (number, db, key, None, parts)
        whole: list[_Message] = []
        later: list[list[_Message]] = [[] for _ in batches]
        for kvkey, (number, db, key, last, parts) in final.items():
            if last is None:
                subjects = [_SUBJECT_PREFIX + kvkey] + [
                    _part_subject(kvkey, n) for n in range(1, parts)
                ]
                later[number].extend(_Message(s, b"", {"KV-Operation": "DEL"}) for s in subjects)
                continue
            messages = self._messages(db, key, last)
            alone = self.publish_whole and len(messages) == 1
            (whole if alone else later[number]).extend(messages)
        groups: list[list[_Message]] = [[]]
        for messages in later:
            if len(messages) > ATOMIC_BATCH_LIMIT:
                raise StoreError(
                    f"a store batch of {len(messages)} messages is over JetStream's atomic batch"
                    f" limit of {ATOMIC_BATCH_LIMIT}"
                )
            if len(groups[-1]) + len(messages) > ATOMIC_BATCH_LIMIT:
                groups.append([])
            groups[-1].extend(messages)
        limit = int(self._nc.max_payload)
        if any(len(m.data) > limit for m in (*whole, *(m for group in groups for m in group))):
            # Refused before anything is sent, so nothing of the write lands.
            raise StoreError("a replicated store message is over the NATS max_payload")
        await self._commit(whole, [group for group in groups if group])

    async def _commit(self, whole: list[_Message], atomic: list[list[_Message]]) -> None:
        """Publish the ``whole`` messages, then each ``atomic`` group as one atomic batch. While
        NATS is reconnecting or the stream elects a leader (no responder, an unanswered write,
        a "temporarily unavailable" answer) it is all sent again (atomic batches under new batch
        ids) until ``timeout`` seconds have passed: the records are the same, so what did land
        before its acknowledgement was lost is only written twice, never changed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        last_failure = "NATS is not connected"
        count = len(whole) + sum(len(group) for group in atomic)
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise StoreUnavailable(
                    f"the replicated state store did not confirm a write of {count}"
                    f" records within {self.timeout:g} s: {last_failure}"
                )
            if not self._nc.is_connected:
                await asyncio.sleep(min(0.1, remaining))
                continue
            try:
                if whole:
                    await self._publish(whole, timeout=min(remaining, _ATTEMPT_TIMEOUT))
                for group in atomic:
                    remaining = max(deadline - loop.time(), 0.001)
                    await self._send(group, timeout=min(remaining, _ATTEMPT_TIMEOUT))
                return
            except _Retry as exc:
                last_failure = str(exc)
            except _NOT_NOW as exc:
                last_failure = repr(exc)
            await asyncio.sleep(min(0.05, max(deadline - loop.time(), 0)))

    async def _publish(self, messages: list[_Message], *, timeout: float) -> None:
        """Publish ``messages`` at once and wait for every acknowledgement."""
        answers = await request_many(
            self._nc, [(m.subject, m.data, m.headers) for m in messages], timeout=timeout
        )
        for answer in answers:
            if answer is None:
                raise _Retry("a record's write was not acknowledged")
            try:
                ack = read_pub_ack(answer.data, "a replicated store write")
            except LogError as exc:
                raise StoreError(str(exc)) from None
            if ack.error is not None:
                if ack.transient:
                    raise _Retry(f"JetStream answered: {ack.error.description}")
                raise StoreError(
                    f"the replicated state store refused a write: {ack.error.description}"
                )

    async def _send(self, messages: list[_Message], *, timeout: float) -> None:
        batch_id = uuid.uuid4().hex
        last = len(messages)
        try:
            for sequence, message in enumerate(messages[:-1], start=1):
                await self._nc.publish(
                    message.subject,
                    message.data,
                    headers={
                        **(message.headers or {}),
                        "Nats-Batch-Id": batch_id,
                        "Nats-Batch-Sequence": str(sequence),
                    },
                )
            final = messages[-1]
            reply = await self._nc.request(
                final.subject,
                final.data,
                timeout=timeout,
                headers={
                    **(final.headers or {}),
                    "Nats-Batch-Id": batch_id,
                    "Nats-Batch-Sequence": str(last),
                    "Nats-Batch-Commit": "1",
                },
            )
        except nats.errors.MaxPayloadError:
            raise StoreError("a replicated store message is over the NATS max_payload") from None
        answer = nats.js.api.PubAck.from_response(_json(reply.data))
        if answer.batch_size != last:
            raise _Retry(f"the commit counted {answer.batch_size} of {last} records")

    # -- reads ------------------------------------------------------------------------------------

    async def get(self, db: str, key: str) -> bytes | None:
        """The record's value, or None when the bucket has none (or a delete marker)."""
        kvkey = kv_key(db, key)
        with _unavailable(f"read {db}"):
            stored = await self._last(_SUBJECT_PREFIX + kvkey)
            return None if stored is None else await self._whole(kvkey, stored)

    async def parts(self, db: str, key: str) -> int:
        """How many messages the stored value takes (1 when absent: its main key)."""
        with _unavailable(f"read {db}"):
            stored = await self._last(_SUBJECT_PREFIX + kv_key(db, key))
        return 1 if stored is None else self.stored_parts(stored)

    async def _listing(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        """Every live (key, stored main bytes) of ``db`` under ``prefix``, in key order: one
        batched direct get per page of the subject filter."""
        found: dict[str, bytes] = {}
        request: dict[str, Any] = {
            "next_by_subj": _filter(db, prefix),
            "batch": _READ_PAGE,
            "max_bytes": 16 * 1024 * 1024,
        }
        with _unavailable(f"scan {db}"):
            async for page in direct_get_pages(self._nc, _STREAM, request, timeout=self.timeout):
                for msg in page.messages:
                    headers = msg.headers or {}
                    kvkey = headers.get("Nats-Subject", "")[len(_SUBJECT_PREFIX) :]
                    # One message per subject is kept; one rewritten during the read shows up
                    # twice, and the later (higher sequence) wins.
                    if _deleted(msg.headers):
                        found.pop(kvkey, None)
                    else:
                        found[kvkey] = msg.data
        out = []
        for kvkey, stored in found.items():
            found_db, key = _store_key(kvkey)
            if found_db == db and key.startswith(prefix):
                out.append((key, stored))
        out.sort()
        return out

    async def scan(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        """Every (key, value) of ``db`` whose key starts with ``prefix``, in key order."""
        listed = await self._listing(db, prefix)
        with _unavailable(f"scan {db}"):
            return [(key, await self._whole(kv_key(db, key), stored)) for key, stored in listed]

    async def keys(self, db: str, prefix: str) -> list[str]:
        """The keys of ``db`` that start with ``prefix``, in key order."""
        return [key for key, _ in await self._listing(db, prefix)]


class _Retry(Exception):
    """A commit the server could not take right now (worth sending again)."""


def _json(data: bytes) -> dict[str, Any]:
    """A write's answer; a refusal is ``StoreError``, "unavailable right now" is ``_Retry``."""
    try:
        answer: dict[str, Any] = json.loads(data)
    except ValueError:
        raise StoreError(f"the replicated state store answered {data[:80]!r}") from None
    error = answer.get("error")
    if error:
        description = error.get("description", error)
        if error.get("code") == 503:
            raise _Retry(f"JetStream answered: {description}")
        raise StoreError(f"the replicated state store refused a write: {description}")
    return answer


@contextlib.contextmanager
def _unavailable(action: str) -> Any:
    try:
        yield
    except UNAVAILABLE_ERRORS as exc:
        raise StoreUnavailable(
            f"the replicated state store is out of reach ({action}): {exc!r}"
        ) from None
    except LogUnavailable as exc:
        raise StoreUnavailable(
            f"the replicated state store is out of reach ({action}): {exc}"
        ) from None


class _LoopThread:
    """An asyncio event loop running in a thread of its own, for synchronous callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="apomesh-store-replica", daemon=True
        )
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, _T], timeout: float) -> _T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise StoreUnavailable(
                f"the replicated state store did not answer within {timeout:g} s"
            ) from None

    def wrap(self, coroutine: Coroutine[Any, Any, _T]) -> Awaitable[_T]:
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


class ReplicatedStore(StoreRecords):
    """``StateStore`` on LMDB (local store and cache) and the replicated bucket; see the module
    docstring. Build it with ``await ReplicatedStore.open(...)``."""

    def __init__(
        self, local: LmdbStore, replica: StateReplica, runner: _LoopThread, nc: NATS
    ) -> None:
        self.local = local
        self.replica = replica
        self._runner = runner
        self._nc = nc
        self._closed = False
        # A call waits for the bucket a little longer than the bucket's own timeouts, so those
        # (with their clearer messages) fire first.
        self._wait = replica.timeout * 3 + 5.0

    @classmethod
    async def open(
        cls,
        local: LmdbStore,
        urls: Sequence[str],
        *,
        replicas: int = 1,
        timeout: float = DEFAULT_TIMEOUT,
        connect_options: dict[str, Any] | None = None,
    ) -> ReplicatedStore:
        """Connect to NATS on a loop thread of its own and open the bucket. Raises what
        ``connect`` raises when NATS cannot be reached, and ``CatalogError`` when the bucket
        cannot be brought to the wanted settings."""
        runner = _LoopThread()
        options = dict(connect_options or {})

        async def opened() -> tuple[NATS, StateReplica]:
            nc = await connect(list(urls), name="apomesh-state-store", **options)
            try:
                return nc, await StateReplica.open(nc, replicas, timeout=timeout)
            except BaseException:
                await close_quietly(nc)
                raise

        try:
            nc, replica = await runner.wrap(opened())
        except BaseException:
            runner.stop()
            raise
        return cls(local, replica, runner, nc)

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        if self._closed:
            coroutine.close()
            raise StoreError("the replicated state store is closed")
        return self._runner.run(coroutine, self._wait)

    # -- writes -----------------------------------------------------------------------------------

    def _replicated(
        self, puts: Puts, deletes: Deletes
    ) -> tuple[list[tuple[str, str, bytes]], list[tuple[str, str, int]]]:
        """The records of a batch that go to the bucket, checked as LMDB checks them; a delete
        carries how many messages its stored value takes."""
        shared_puts = []
        for db, key, value in puts:
            check_database(db)
            encode_key(key)
            if db not in LOCAL_DATABASES:
                shared_puts.append((db, key, bytes(value)))
        shared_deletes = []
        for db, key in deletes:
            check_database(db)
            encode_key(key)
            if db in LOCAL_DATABASES:
                continue
            cached = self.local.get(db, key)
            parts = (
                self.replica.part_count(len(cached))
                if cached is not None
                else self._run(self.replica.parts(db, key))
            )
            shared_deletes.append((db, key, parts))
        return shared_puts, shared_deletes

    def write_batch(self, puts: Puts, deletes: Deletes = ()) -> None:
        """Write the batch to the bucket (``StateReplica.write``: all or nothing on an R3
        bucket), then to LMDB (one synced transaction); returns when both hold it."""
        shared = self._replicated(puts, deletes)
        if shared[0] or shared[1]:
            self._run(self.replica.write([shared]))
        self.local.write_batch(puts, deletes)

    def write_batches(self, batches: Sequence[tuple[Puts, Deletes]]) -> None:
        """Several batches with one bucket write and one LMDB transaction."""
        shared = [self._replicated(puts, deletes) for puts, deletes in batches]
        if any(p or d for p, d in shared):
            self._run(self.replica.write(shared))
        self.local.write_batches(batches)

    def delete_snapshots_before(self, agent_key: str, snapshot_id: int) -> int:
        end = snapshot_key(agent_key, snapshot_id)
        doomed = [
            ("snapshots", key)
            for key in self._run(self.replica.keys("snapshots", snapshot_prefix(agent_key)))
            if key < end
        ]
        local = [
            ("snapshots", key)
            for key, _ in self.local.scan("snapshots", snapshot_prefix(agent_key))
        ]
        doomed_keys = {key for _, key in doomed}
        stale = [(db, key) for db, key in local if key < end and key not in doomed_keys]
        # In slices under the atomic batch limit: deleting old snapshots needs no atomicity.
        for start in range(0, len(doomed), _DELETE_SLICE):
            self.write_batch([], doomed[start : start + _DELETE_SLICE])
        if stale:
            self.local.write_batch([], stale)
        return len(doomed)

    # -- reads ------------------------------------------------------------------------------------

    def _cache(self, records: list[tuple[str, str, bytes]]) -> None:
        if not records:
            return
        try:
            self.local.write_batch(records)
        except StoreError as exc:  # a cache that cannot be filled only costs later reads
            log.warning("could not cache %d replicated records in LMDB: %s", len(records), exc)

    def get(self, db: str, key: str) -> bytes | None:
        """LMDB first for records that never change once written (``completed``); the bucket
        first for the others, whose keys a later writer may write again (a snapshot id is reused
        once an unlogged snapshot is dropped, a compacted segment is trimmed, a journal copy goes
        from intent to result), so a copy in LMDB may be older than the bucket's."""
        if db in LOCAL_DATABASES:
            return self.local.get(db, key)
        cached = self.local.get(db, key)
        if cached is not None and db in WRITE_ONCE_DATABASES:
            return cached
        value = self._run(self.replica.get(db, key))
        if value is not None and cached is None:
            self._cache([(db, key, value)])
        return value

    def scan_here(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        """LMDB's copy alone: what this daemon wrote through, and what it read back since (a
        restart's fold checkpoints: 100,000 of them read from the bucket took longer than the
        replica's timeout)."""
        return self.local.scan(db, prefix)

    def scan(self, db: str, prefix: str) -> list[tuple[str, bytes]]:
        check_database(db)
        if db in LOCAL_DATABASES:
            return self.local.scan(db, prefix)
        found = self._run(self.replica.scan(db, prefix))
        cached = dict(self.local.scan(db, prefix))
        self._cache([(db, key, value) for key, value in found if key not in cached])
        return found

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the NATS connection, the loop thread and LMDB; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._runner.run(close_quietly(self._nc), 10.0)
        self._runner.stop()
        self.local.close()

    def __enter__(self) -> ReplicatedStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
