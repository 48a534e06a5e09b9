"""Typed wrappers over JetStream KV: published agents, the skill catalog and session leases.

Four buckets, opened together by ``KvBuckets.open`` (``open_bucket`` creates or reconciles any
bucket, also the replicated state store's):

- ``APOMESH_AGENTS`` (``AgentRegistry``): published agents, create-only. Publishing the same
  bytes again is a no-op; other bytes under an existing key is ``PublishConflict``, because a
  published (name, version) is immutable.
- ``APOMESH_SKILLS`` (``SkillCatalog``): the mutable skill catalog, keeping the last revisions of
  each skill (``history``).
- ``APOMESH_LEASES`` (``LeaseTable``): which daemon drives which session. A lease is a key whose
  value is the owner; it is taken by create-if-absent, taken over by compare-and-set on its
  revision once its owner is not alive, and released by compare-and-set, so two daemons never
  drive the same session. It has no TTL of its own: its owner's presence record keeps it alive.
- ``APOMESH_DAEMONS`` (``PresenceTable``): which daemons are alive. Each daemon puts its record
  (an opaque value: ``runtime.presence`` encodes it) under its id and renews it well inside the
  bucket's TTL (the lease TTL, a third of it, say), which ages out the record of a daemon that
  died, and with it every lease that names it. A record too large for one message is put in
  parts under a small head (``PresenceTable``).

KV keys allow only ``[-/_=.a-zA-Z0-9]`` and no leading, trailing or doubled dots, so names are
encoded reversibly (``encode_key``): letters, digits, ``-`` and ``_`` stay, every other byte of
the UTF-8 name becomes ``=XX``. Connection failures raise ``LogUnavailable`` ("NATS cannot be
reached"); a bucket whose settings cannot be brought to the wanted ones raises ``CatalogError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from apomesh.adapters.nats_connect import (
    NATS,
    WRONG_LAST_SEQUENCE,
    direct_get_pages,
    read_pub_ack,
    request_many,
    unavailable_as_log_error,
)
from apomesh.core.errors import CatalogError, LogError, LogUnavailable, PublishConflict

AGENTS_BUCKET = "APOMESH_AGENTS"
SKILLS_BUCKET = "APOMESH_SKILLS"
LEASES_BUCKET = "APOMESH_LEASES"
DAEMONS_BUCKET = "APOMESH_DAEMONS"
DEFAULT_SKILL_HISTORY = 16
DEFAULT_LEASE_TTL = 30.0
LEASE_WINDOW = 1024
"""How many lease creates ``LeaseTable.acquire_many`` sends together (one window)."""
SET_WINDOWS_IN_FLIGHT = 2
"""How many of those windows ``LeaseTable.acquire_many`` has out at once: the server stores one
while this daemon reads the answers to the other (one at a time, 50,000 leases took 1.3 s; two,
1.0 s)."""
HOLDERS_PAGE = 10_000
"""How many leases ``LeaseTable.holders`` reads a page."""
READ_TOGETHER = 64
"""How many lease reads ``LeaseTable.owners`` has in flight at once."""

_log = logging.getLogger("apomesh.leases")

_PLAIN = re.compile(r"[A-Za-z0-9_-]")
_ALL_PLAIN = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPE = re.compile(r"=([0-9A-F]{2})")


def encode_key(name: str) -> str:
    """A KV-safe key for any non-empty name, reversible with ``decode_key``."""
    if not name:
        raise ValueError("a KV key cannot be empty")
    if _ALL_PLAIN.fullmatch(name):
        return name  # a session id, most often: nothing to escape
    return "".join(
        char if _PLAIN.fullmatch(char) else "".join(f"={byte:02X}" for byte in char.encode("utf-8"))
        for char in name
    )


def decode_key(key: str) -> str:
    """The name ``encode_key`` made ``key`` from."""
    raw = bytearray()
    position = 0
    for match in _ESCAPE.finditer(key):
        raw.extend(key[position : match.start()].encode("ascii"))
        raw.append(int(match.group(1), 16))
        position = match.end()
    raw.extend(key[position:].encode("ascii"))
    return raw.decode("utf-8")


class Revision(msgspec.Struct, frozen=True):
    """One revision of a key: its number, its value, and whether it was a deletion."""

    revision: int
    value: bytes
    deleted: bool


async def open_bucket(
    js: JetStreamContext,
    config: KeyValueConfig,
    *,
    allow_atomic: bool = False,
    keep_forever: bool = False,
) -> KeyValue:
    """Create the bucket, or open it and bring replicas, history and TTL to the wanted ones (a
    bucket opened without a TTL keeps the one it has, unless ``keep_forever``: then it has none),
    and direct gets on when ``config.direct``; ``allow_atomic`` also turns on JetStream's atomic
    batch publish on its stream."""
    bucket = config.bucket
    with unavailable_as_log_error(f"open bucket {bucket}"):
        try:
            created = await js.create_key_value(config)
            if not allow_atomic:
                return created
        except nats.js.errors.APIError as exc:
            if exc.err_code != 10058:  # "stream name already in use with a different configuration"
                raise CatalogError(
                    f"cannot create bucket {bucket} with replicas={config.replicas},"
                    f" history={config.history}, ttl={config.ttl}: {exc.description}"
                ) from None
        stream = f"KV_{bucket}"
        current = (await js.stream_info(stream)).config
        max_age = config.ttl if config.ttl else (0.0 if keep_forever else current.max_age)
        window = current.duplicate_window
        if max_age and window and window > max_age:
            window = max_age  # the server refuses a duplicate window longer than the max age
        wanted = replace(
            current,
            num_replicas=config.replicas,
            max_msgs_per_subject=config.history,
            max_age=max_age,
            duplicate_window=window,
            allow_atomic=True if allow_atomic else current.allow_atomic,
            allow_direct=True if config.direct else current.allow_direct,
        )
        try:
            await js.update_stream(wanted)
        except nats.js.errors.APIError as exc:
            raise CatalogError(
                f"bucket {bucket} has replicas={current.num_replicas}, history={current.max_msgs_per_subject},"
                f" ttl={current.max_age}; wanted {config.replicas}, {config.history}, {config.ttl};"
                f" the server refused the update: {exc.description}"
            ) from None
        return await js.key_value(bucket)


# The KV-Operation header values of a message that deletes its key.
_DELETIONS = ("DEL", "PURGE")


async def _value(kv: KeyValue, key: str) -> tuple[bytes, int] | None:
    """The key's current value and revision, or None when it is absent or deleted."""
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    return (entry.value or b"", entry.revision or 0)


async def _last_message(kv: KeyValue, key: str) -> tuple[bytes, int] | None:
    """The key's value and revision as its last message left it (a deletion: an empty value at
    the delete marker's revision), or None when it has no message."""
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError as exc:
        deleted = exc.entry
        if deleted is None or not deleted.revision:
            return None
        return (b"", deleted.revision)
    return (entry.value or b"", entry.revision or 0)


async def _keys(js: JetStreamContext, kv: KeyValue, bucket: str) -> list[str]:
    """The keys of ``bucket`` that hold a value now, sorted.

    Read from the stream's own subject list, then each key's last message (a deleted key keeps
    its delete marker's subject), not from a key watcher: the watcher behind ``KeyValue.keys``
    can mark the end of its initial values while the first of them are still in flight, and then
    answers no keys at all. (The server lists up to 100,000 subjects in one answer: far more
    skills or published agents than a catalog holds.)"""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=prefix + ">")
    keys = [subject[len(prefix) :] for subject in info.state.subjects or {}]
    found = await asyncio.gather(*(_value(kv, key) for key in keys))
    return sorted(decode_key(key) for key, value in zip(keys, found, strict=True) if value)


class AgentRegistry:
    """Published agents: create-only, by key (e.g. ``name@version``)."""

    def __init__(self, kv: KeyValue, js: JetStreamContext) -> None:
        self._kv = kv
        self._js = js

    async def create(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key``; identical bytes again is a no-op, other bytes raise
        ``PublishConflict``."""
        encoded = encode_key(key)
        with unavailable_as_log_error(f"publish agent {key}"):
            try:
                await self._kv.create(encoded, value)
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                existing = await _value(self._kv, encoded)
        if existing is not None and existing[0] == value:
            return
        raise PublishConflict(f"agent {key} is already published with other content")

    async def get(self, key: str) -> bytes | None:
        with unavailable_as_log_error(f"get agent {key}"):
            found = await _value(self._kv, encode_key(key))
        return found[0] if found else None

    async def keys(self) -> list[str]:
        with unavailable_as_log_error("list agents"):
            return await _keys(self._js, self._kv, AGENTS_BUCKET)


class SkillCatalog:
    """The mutable skill catalog, with the last revisions of each skill kept."""

    def __init__(self, kv: KeyValue, js: JetStreamContext) -> None:
        self._kv = kv
        self._js = js

    async def put(self, name: str, body: bytes) -> int:
        """Store a new revision of the skill; returns its revision number."""
        with unavailable_as_log_error(f"put skill {name}"):
            return await self._kv.put(encode_key(name), body)

    async def get(self, name: str) -> bytes | None:
        with unavailable_as_log_error(f"get skill {name}"):
            found = await _value(self._kv, encode_key(name))
        return found[0] if found else None

    async def get_revision(self, name: str) -> tuple[bytes, int] | None:
        """The skill's body and revision number, or None."""
        with unavailable_as_log_error(f"get skill {name}"):
            return await _value(self._kv, encode_key(name))

    async def delete(self, name: str) -> None:
        with unavailable_as_log_error(f"delete skill {name}"):
            await self._kv.delete(encode_key(name))

    async def keys(self) -> list[str]:
        with unavailable_as_log_error("list skills"):
            return await _keys(self._js, self._kv, SKILLS_BUCKET)

    async def history(self, name: str) -> list[Revision]:
        """The kept revisions of the skill, oldest first (deletions included)."""
        # Message by message along the key's subject, not through ``KeyValue.history``, whose
        # watcher can end before the first message arrives and answer no history at all.
        subject = f"$KV.{SKILLS_BUCKET}.{encode_key(name)}"
        revisions: list[Revision] = []
        seq = 1
        with unavailable_as_log_error(f"skill history {name}"):
            while True:
                try:
                    msg = await self._js.get_msg(
                        f"KV_{SKILLS_BUCKET}", seq=seq, subject=subject, next=True
                    )
                except nats.js.errors.NotFoundError:
                    return revisions
                operation = (msg.headers or {}).get("KV-Operation")
                revisions.append(Revision(msg.seq or 0, msg.data or b"", operation in _DELETIONS))
                seq = (msg.seq or seq) + 1


def _created(session_id: str, answer: bytes) -> int | None:
    """The revision a lease's conditional publish answer (a JetStream PubAck) gives, or None when
    the key was not at the revision expected (for a create, 0: no message at all; a release's
    delete marker counts as one, which the bucket's own ``create`` in ``acquire`` takes into
    account). Raises ``LogUnavailable`` when JetStream could not store it, ``LogError`` for
    another refusal. Raw creates cost about half the CPU of the bucket's ``create`` (20,000 in
    0.8 s of CPU against 1.5 s); sent together by ``request_many``, less again."""
    ack = read_pub_ack(answer, f"lease {session_id}")
    if ack.error is None:
        return ack.seq
    if ack.wrong_last_sequence:
        return None
    if ack.transient:
        raise LogUnavailable(f"lease {session_id}: {ack.error.description}")
    raise LogError(f"lease {session_id}: {ack.reason}")


class LeaseTable:
    """Session ownership leases, kept alive by their owner's presence record.

    A lease is a key (the session) whose value is its owner (a daemon id); it is taken by
    create-if-absent, or by compare-and-set on its revision once its owner is not alive, and
    released by a compare-and-set delete. It has no TTL of its own: it holds while its owner's
    record is in the presence bucket (``APOMESH_DAEMONS``, whose TTL ages the record of a daemon
    that died out), so a daemon renews one record, not one lease per session it drives. A daemon
    learns that a lease of its own was taken (``watch``), and an append of a stale writer is
    refused by the log's expected-sequence check in any case."""

    def __init__(
        self,
        kv: KeyValue,
        presence: KeyValue,
        js: JetStreamContext,
        ttl: float,
        nc: NATS,
        timeout: float,
    ) -> None:
        self._kv = kv
        self._presence = presence
        self._js = js
        self._nc = nc
        self._timeout = timeout
        self.ttl = ttl
        """The presence TTL: how long a lease outlives the last renewal of its owner's record."""
        self._taken: dict[tuple[str, str], int] = {}
        """The revision of each lease this table took, by (session, owner) (a release deletes at that revision in one
        request; a lease moved since is read before anything is deleted)."""
        self._last_read: dict[str, tuple[bytes, int]] = {}
        """Each lease as the last ``holders`` or ``owners`` read it (its value, empty once
        released, and its revision): where ``acquire_many`` finds a lease existing already, it
        sets it at that revision (one compare-and-set, sent with the others) instead of reading
        it first, and ``acquire`` does the same for one lease; each takes out what it used."""

    async def acquire(self, session_id: str, owner: str) -> bool:
        """Take the session's lease; True when ``owner`` now holds it (already holding it, or
        taking it over from an owner that is not alive)."""
        key = encode_key(session_id)
        mine = owner.encode()
        with unavailable_as_log_error(f"acquire lease {session_id}"):
            read = self._last_read.get(session_id)
            if read is not None and read[0] in (mine, b""):
                # Ours or released when ``holders`` last read it (a restarted daemon's own
                # stranded sessions, resumed by an operator): one compare-and-set at the
                # revision read, not a refused create and a read. Moved since, it is decided
                # below.
                del self._last_read[session_id]
                revision = await self._swap(key, mine, read[1])
                if revision is not None:
                    self._taken[session_id, owner] = revision
                    return True
            for _ in range(3):
                try:
                    self._taken[session_id, owner] = await self._kv.create(key, mine)
                    return True
                except nats.js.errors.KeyWrongLastSequenceError:
                    pass
                held = await _value(self._kv, key)
                if held is None:
                    continue  # released between our two calls: try to create again
                if held[0] == mine:
                    self._taken[session_id, owner] = held[1]
                    return True
                if await self._alive(held[0]):
                    return False
                revision = await self._swap(key, mine, held[1])
                if revision is None:
                    return False
                self._taken[session_id, owner] = revision
                return True
        return False

    def keep_reads(self, session_ids: Collection[str]) -> None:
        """Keep what ``holders`` and ``owners`` read of these sessions' leases only (a boot scan
        keeps its stranded sessions', for an operator's resume; the others' would only take
        memory)."""
        read = self._last_read
        self._last_read = {s: r for s in session_ids if (r := read.get(s)) is not None}

    async def acquire_many(
        self, session_ids: Sequence[str], owner: str, *, window: int = LEASE_WINDOW
    ) -> set[str]:
        """``acquire`` for many sessions at once (a boot scan's, a takeover's), sent ``window``
        at a time (``_set_many``): a lease the last ``holders`` or ``owners`` read is set at the
        revision read, as ``acquire`` would take it (held by ``owner``, released, or taken over
        from an owner that is not alive; a live owner's is left alone, with no request), and
        the others are created; a lease that refuses either (it moved since the read, or it
        exists unread) is taken one by one. Answers the sessions ``owner`` now holds; a session
        whose lease NATS could not answer for is not among them (its caller asks again later).
        A daemon restarted on its data dir finds every lease of its sessions held by itself:
        50,000 of them were taken one by one in 53 s, two requests each; together, a refused
        create and a compare-and-set each, its adoption of them took 2.03 s in all, and with
        the compare-and-set alone 1.16-1.49 s."""
        taken: set[str] = set()
        # The reads of these sessions only: an ``acquire_many`` for others (the boot scan's
        # auto-resumed ones, often none) leaves the rest for an operator's resume to use.
        read = {s: r for s in session_ids if (r := self._last_read.pop(s, None)) is not None}
        mine = owner.encode()
        alive: dict[bytes, bool] = {}
        wanted: list[tuple[str, int]] = []
        for session_id in session_ids:
            value = read.get(session_id)
            if value is None:
                wanted.append((session_id, 0))  # never read: created if absent
                continue
            holder, revision = value
            if holder and holder != mine:
                if holder not in alive:
                    alive[holder] = await self._alive_or_unknown(holder)
                if alive[holder]:
                    continue  # a live owner's (or one NATS cannot tell of): not taken now
            wanted.append((session_id, revision))
        for session_id in await self._set_many(wanted, owner, taken, window):
            with contextlib.suppress(LogUnavailable):
                if await self.acquire(session_id, owner):
                    taken.add(session_id)
        return taken

    async def _set_many(
        self, wanted: Sequence[tuple[str, int]], owner: str, taken: set[str], window: int
    ) -> list[str]:
        """Set each lease of ``wanted`` (session, the revision it must be at: 0 for a key with no
        message yet) to ``owner``, by raw conditional publishes sent ``window`` at a time
        (``request_many``; ``SET_WINDOWS_IN_FLIGHT`` windows out at once), each window's answers
        awaited together: those set are added to ``taken``, their revision noted. Answers the
        sessions whose lease was not at that revision; one NATS could not answer for is in
        neither."""
        mine = owner.encode()
        contested: list[str] = []
        in_flight = asyncio.Semaphore(SET_WINDOWS_IN_FLIGHT)

        async def one_window(chunk: Sequence[tuple[str, int]]) -> None:
            requests = [
                (
                    f"$KV.{LEASES_BUCKET}.{encode_key(session_id)}",
                    mine,
                    {"Nats-Expected-Last-Subject-Sequence": str(revision)},
                )
                for session_id, revision in chunk
            ]
            async with in_flight:
                try:
                    answers = await request_many(self._nc, requests, timeout=self._timeout)
                except LogUnavailable as exc:
                    _log.debug("%d leases not taken yet: %r", len(chunk), exc)
                    return
            for (session_id, _), answer in zip(chunk, answers, strict=True):
                if answer is None:
                    _log.debug("lease %s not taken yet: not answered", session_id)
                    continue
                try:
                    revision = _created(session_id, answer.data)
                except LogUnavailable as exc:
                    _log.debug("lease %s not taken yet: %r", session_id, exc)
                    continue
                if revision is None:
                    contested.append(session_id)
                else:
                    self._taken[session_id, owner] = revision
                    taken.add(session_id)

        await asyncio.gather(
            *(one_window(wanted[first : first + window]) for first in range(0, len(wanted), window))
        )
        return contested

    async def release(self, session_id: str, owner: str) -> bool:
        """Give the lease up if ``owner`` holds it; True when it was released. A lease this table
        took is deleted at the revision it took it at (one request); one that moved since, or
        that it did not take, is read first."""
        key = encode_key(session_id)
        with unavailable_as_log_error(f"release lease {session_id}"):
            revision = self._taken.pop((session_id, owner), None)
            if revision is not None:
                try:
                    await self._kv.delete(key, last=revision)
                    return True
                except nats.js.errors.APIError as exc:
                    if exc.err_code not in WRONG_LAST_SEQUENCE:
                        raise
            held = await _value(self._kv, key)
            if held is None or held[0] != owner.encode():
                return False
            try:
                await self._kv.delete(key, last=held[1])
            except nats.js.errors.APIError as exc:
                if exc.err_code in WRONG_LAST_SEQUENCE:
                    return False
                raise
            return True

    async def owner(self, session_id: str) -> str | None:
        """Who holds the session's lease now (its owner is alive), or None."""
        with unavailable_as_log_error(f"lease owner {session_id}"):
            held = await _value(self._kv, encode_key(session_id))
            if held is None or not await self._alive(held[0]):
                return None
        return held[0].decode()

    async def owners(self, session_ids: Sequence[str]) -> dict[str, str]:
        """``owner`` for many sessions: their leases read ``READ_TOGETHER`` at a time, each
        owner's presence once. Answers the sessions whose lease an owner that is alive holds ->
        that owner. What it read is kept for the next ``acquire_many``, as ``holders`` keeps its
        read (a takeover of a gone daemon's sessions asks this of them, then adopts them)."""
        gate = asyncio.Semaphore(READ_TOGETHER)
        read: dict[str, tuple[bytes, int]] = {}

        async def one(session_id: str) -> None:
            async with gate:
                held = await _last_message(self._kv, encode_key(session_id))
            if held is not None:
                read[session_id] = held

        with unavailable_as_log_error(f"lease owners of {len(session_ids)} sessions"):
            await asyncio.gather(*(one(s) for s in session_ids))
            alive = {
                holder
                for holder in {value for value, _ in read.values() if value}
                if await self._alive(holder)
            }
        self._last_read.update(read)
        return {s: value.decode() for s, (value, _) in read.items() if value in alive}

    async def holders(self, timeout: float = 10.0) -> dict[str, str]:
        """Every session whose lease is held now -> its holder, from one pass over the bucket's
        stream in pages of batched direct gets, ``direct_get_pages`` (not one read per session:
        the boot scan asks this of every stored session; not a watcher, whose every entry costs
        a ``Msg`` and a task switch: 50,000 leases took 1.9-3.3 s of the daemon's CPU that
        way), less the leases of owners that are not alive. The pass reads to the stream's end as it goes (a
        key's last message is its value; one rewritten meanwhile is met again later in the
        pass, and the later wins). A direct get may be answered by a replica a moment behind
        the leader: what this returns is a belief, as any read of leases that move is, and
        every lease is taken by a compare-and-set.

        What it read (each lease's value and revision, the released ones too) is kept for the
        next ``acquire_many``, which sets the existing leases it meets at those revisions."""
        named: dict[str, str] = {}
        read: dict[str, tuple[bytes, int]] = {}
        stream, prefix = f"KV_{LEASES_BUCKET}", f"$KV.{LEASES_BUCKET}."
        with unavailable_as_log_error("list the session leases"):
            request = {"batch": HOLDERS_PAGE}  # by sequence alone: the stream holds only leases
            async for page in direct_get_pages(self._nc, stream, request, timeout=timeout):
                for msg in page.messages:
                    headers = msg.headers or {}
                    session = decode_key(headers.get("Nats-Subject", "")[len(prefix) :])
                    revision = int(headers.get("Nats-Sequence") or 0)
                    if headers.get("KV-Operation") in _DELETIONS or not msg.data:
                        named.pop(session, None)
                        read[session] = (b"", revision)
                    else:
                        named[session] = msg.data.decode()
                        read[session] = (msg.data, revision)
            alive = {owner for owner in set(named.values()) if await self._alive(owner.encode())}
        self._last_read = read
        return {session: owner for session, owner in named.items() if owner in alive}

    async def position(self) -> int:
        """Where the leases' stream is now (its last sequence): a later ``watch`` can start there."""
        with unavailable_as_log_error("read the leases' position"):
            return int((await self._js.stream_info(f"KV_{LEASES_BUCKET}")).state.last_seq)

    async def watch(
        self,
        on_change: Callable[[str, str | None], None],
        *,
        since: int | None = None,
        owner: str | None = None,
    ) -> Callable[[], Awaitable[None]]:
        """Call ``on_change(session_id, owner)`` for every lease taken, taken over (``owner``) or
        released (None) from now on, or with ``since`` (a ``position``) every change after it;
        answers the function that stops watching.

        When every change after ``since`` is one this table made for ``owner`` (a boot scan's
        tens of thousands of lease creates, say: the stream's sequences are consecutive, so
        that many revisions taken among them leave no room for anyone else's), none is delivered
        again and the watch starts after them: each would cost the daemon a message through the
        client's consumer machinery to say what it knows (about 0.45 s of a boot scan that
        takes 50,000 leases). Any other change among them, or a revision of them no longer
        known here (a lease taken and released again), and every change after ``since`` is
        delivered."""
        prefix = f"$KV.{LEASES_BUCKET}."
        start: int | None = None
        if since is not None:
            last = await self.position()
            mine = sum(
                1
                for (_, taker), revision in self._taken.items()
                if taker == owner and since < revision <= last
            )
            start = last + 1 if mine == last - since else since + 1

        async def changed(msg: Any) -> None:
            if not msg.subject.startswith(prefix):
                return
            operation = (msg.headers or {}).get("KV-Operation")
            owner = None if operation in _DELETIONS or not msg.data else msg.data.decode()
            on_change(decode_key(msg.subject[len(prefix) :]), owner)

        with unavailable_as_log_error("watch the session leases"):
            subscription = await self._js.subscribe(
                prefix + ">",
                stream=f"KV_{LEASES_BUCKET}",
                cb=changed,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.NEW
                if start is None
                else DeliverPolicy.BY_START_SEQUENCE,
                config=None if start is None else ConsumerConfig(opt_start_seq=start),
            )
        return subscription.unsubscribe

    async def _alive_or_unknown(self, owner: bytes) -> bool:
        """``_alive``, and True when NATS cannot say (its leases are then left alone for now,
        as ``acquire_many`` leaves a lease NATS does not answer for)."""
        try:
            with unavailable_as_log_error(f"presence of {owner.decode()}"):
                return await self._alive(owner)
        except LogUnavailable as exc:
            _log.debug("leases of %s not taken yet: %r", owner.decode(), exc)
            return True

    async def _alive(self, owner: bytes) -> bool:
        """Whether the owner's presence record is there (renewed within the presence TTL)."""
        found = await _value(self._presence, encode_key(owner.decode()))
        return found is not None and bool(found[0])

    async def _swap(self, key: str, value: bytes, revision: int) -> int | None:
        """Compare-and-set ``key`` to ``value``; the new revision, or None when it moved."""
        try:
            return await self._kv.update(key, value, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return None


PRESENCE_PART_BYTES = 256 * 1024
"""The largest presence value put whole: a record over it is put in parts of this size, well
under the 1 MiB ``max_payload`` a nats-server has by default (a daemon listing 100,000 sessions
has a record of about 3.4 MB)."""


def presence_part_bytes(max_payload: int | None) -> int:
    """The presence part size for a connection whose ``max_payload`` is given (None: unknown):
    ``PRESENCE_PART_BYTES``, or a quarter of a smaller limit, leaving room for the subject and
    the KV headers."""
    if max_payload is None:
        return PRESENCE_PART_BYTES
    return max(1024, min(PRESENCE_PART_BYTES, int(max_payload) // 4))


_PARTS = "parts"
_PART_TOKEN = ".part."


class PresenceTable:
    """The live daemons' records, by daemon id, aged out by the bucket's TTL.

    A record over ``part_bytes`` is put in parts: the parts first, each under
    ``<daemon>.part.<generation>.<n>``, then under the daemon's own key a head (msgpack
    ``["parts", generation, count, size]``) naming them. The daemon's own key is always the one
    whose presence keeps its leases alive. A generation's parts are deleted two puts later, so a
    reader that took the previous head still finds its parts; one that finds a part missing reads
    the bucket again. A record that fits is put whole, as releases before parts put every one."""

    def __init__(
        self, kv: KeyValue, ttl: float, js: JetStreamContext, part_bytes: int = PRESENCE_PART_BYTES
    ) -> None:
        self._kv = kv
        self._js = js
        self.ttl = ttl
        self.part_bytes = part_bytes
        self._generation = 0
        self._token = uuid.uuid4().hex[:8]
        self._parted: dict[str, list[tuple[str, int]]] = {}
        """Per daemon, the generations of parts put and not deleted yet (newest last)."""
        self._joined: dict[str, tuple[str, bytes]] = {}
        """Per KV key, the last record read (or put) in parts and its generation: a generation's
        parts never change, so a head naming it again is answered without reading them."""

    async def put(self, daemon_id: str, record: bytes) -> None:
        key = encode_key(daemon_id)
        with unavailable_as_log_error(f"publish daemon {daemon_id}"):
            if len(record) <= self.part_bytes:
                await self._kv.put(key, record)
                await self._drop_parts(daemon_id, keep=0)
                return
            self._generation += 1
            generation = f"{self._token}{self._generation}"
            size = self.part_bytes
            pieces = [record[at : at + size] for at in range(0, len(record), size)]
            await asyncio.gather(
                *(
                    self._kv.put(_part_key(key, generation, n), piece)
                    for n, piece in enumerate(pieces)
                )
            )
            head = msgspec.msgpack.encode([_PARTS, generation, len(pieces), len(record)])
            await self._kv.put(key, head)
            self._joined[key] = (generation, record)
            self._parted.setdefault(daemon_id, []).append((generation, len(pieces)))
            await self._drop_parts(daemon_id, keep=2)

    async def _drop_parts(self, daemon_id: str, keep: int) -> None:
        """Delete the daemon's part generations but the ``keep`` newest (best effort: parts
        left behind age out with the bucket's TTL)."""
        kept = self._parted.get(daemon_id, [])
        if len(kept) <= keep:
            return
        dropped, self._parted[daemon_id] = kept[: len(kept) - keep], kept[len(kept) - keep :]
        key = encode_key(daemon_id)
        with contextlib.suppress(Exception):
            for generation, count in dropped:
                for n in range(count):
                    await self._kv.delete(_part_key(key, generation, n))

    async def delete(self, daemon_id: str) -> None:
        with unavailable_as_log_error(f"withdraw daemon {daemon_id}"):
            await self._kv.delete(encode_key(daemon_id))
        await self._drop_parts(daemon_id, keep=0)

    async def all(self) -> dict[str, bytes]:
        """Every live daemon's record, by id (a record deleted or aged out is absent), parts
        put together."""
        for _ in range(3):
            records = await self._records()
            if records is not None:
                return records
        raise LogUnavailable("list daemons: a presence record's parts kept changing while read")

    async def _records(self) -> dict[str, bytes] | None:
        """The records, or None when a head names a part that is gone (it was replaced while
        being read: read again)."""
        # The stream's own subject list, not a key watcher: records ageing out while a watcher
        # counts what is pending can make it stop before the newest keys.
        prefix = f"$KV.{DAEMONS_BUCKET}."
        records: dict[str, bytes] = {}
        with unavailable_as_log_error("list daemons"):
            info = await self._js.stream_info(f"KV_{DAEMONS_BUCKET}", subjects_filter=prefix + ">")
            for subject in info.state.subjects or {}:
                key = subject[len(prefix) :]
                if _PART_TOKEN in key:
                    continue  # read through its head, if one names it
                found = await _value(self._kv, key)
                if found is None or not found[0]:
                    continue
                record = await self._whole(key, found[0])
                if record is None:
                    return None
                records[decode_key(key)] = record
        for gone in set(self._joined) - {encode_key(daemon) for daemon in records}:
            del self._joined[gone]  # a daemon whose record aged out or was withdrawn
        return records

    async def _whole(self, key: str, value: bytes) -> bytes | None:
        """The record under ``key`` whose value is ``value``: itself, or the parts its head
        names joined (None when one is missing or they do not add up)."""
        head = _parts_head(value)
        if head is None:
            return value
        generation, count, size = head
        cached = self._joined.get(key)
        if cached is not None and cached[0] == generation:
            return cached[1]
        found = await asyncio.gather(
            *(_value(self._kv, _part_key(key, generation, n)) for n in range(count))
        )
        pieces = [piece[0] for piece in found if piece is not None]
        record = _joined(pieces, count, size)
        if record is not None:
            self._joined[key] = (generation, record)
        return record


def _part_key(key: str, generation: str, n: int) -> str:
    return f"{key}{_PART_TOKEN}{generation}.{n}"


def _joined(pieces: list[bytes], count: int, size: int) -> bytes | None:
    """The record a head of ``count`` parts and ``size`` bytes names, from the ``pieces`` found
    (None unless all of them are there and add up)."""
    if len(pieces) != count:
        return None
    record = b"".join(pieces)
    return record if len(record) == size else None


def _parts_head(value: bytes) -> tuple[str, int, int] | None:
    """(generation, count, size) when ``value`` is the head of a record put in parts."""
    if not value or value[0] != 0x94:  # a msgpack array of four; a record is a map
        return None
    try:
        marker, generation, count, size = msgspec.msgpack.decode(value)
    except (msgspec.DecodeError, ValueError, TypeError):
        return None
    if marker != _PARTS or not isinstance(generation, str):
        return None
    if not isinstance(count, int) or not isinstance(size, int):
        return None
    return generation, count, size


class KvBuckets(msgspec.Struct, frozen=True):
    """The four buckets the runtime uses."""

    agents: AgentRegistry
    skills: SkillCatalog
    leases: LeaseTable
    daemons: PresenceTable

    @classmethod
    async def open(
        cls,
        nc: NATS,
        replicas: int = 1,
        *,
        timeout: float = 5.0,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        skill_history: int = DEFAULT_SKILL_HISTORY,
    ) -> KvBuckets:
        """Create or open the buckets with ``replicas`` copies each on ``nc``, its JetStream
        requests answered within ``timeout`` seconds; presence parts stay well under the
        connection's ``max_payload``."""
        js = nc.jetstream(timeout=timeout)
        max_payload = nc.max_payload
        agents = await open_bucket(
            js,
            KeyValueConfig(
                bucket=AGENTS_BUCKET,
                description="apomesh published agents (create-only)",
                history=1,
                replicas=replicas,
                storage=StorageType.FILE,
            ),
        )
        skills = await open_bucket(
            js,
            KeyValueConfig(
                bucket=SKILLS_BUCKET,
                description="apomesh skill catalog",
                history=skill_history,
                replicas=replicas,
                storage=StorageType.FILE,
            ),
        )
        await open_bucket(
            js,
            KeyValueConfig(
                bucket=LEASES_BUCKET,
                description="apomesh session ownership leases (held while the owner is present)",
                history=1,
                replicas=replicas,
                storage=StorageType.FILE,
                direct=True,  # for ``LeaseTable.holders``'s pages
            ),
            keep_forever=True,
        )
        # A lease's own reads go to the stream's leader, never to a replica that may be behind
        # (direct gets): ``acquire`` trusts what it reads of its own lease.
        leases = KeyValue(
            name=LEASES_BUCKET,
            stream=f"KV_{LEASES_BUCKET}",
            pre=f"$KV.{LEASES_BUCKET}.",
            js=js,
            direct=False,
        )
        daemons = await open_bucket(
            js,
            KeyValueConfig(
                bucket=DAEMONS_BUCKET,
                description="apomesh live daemons (presence)",
                history=1,
                ttl=lease_ttl,
                replicas=replicas,
                storage=StorageType.FILE,
            ),
        )
        return cls(
            AgentRegistry(agents, js),
            SkillCatalog(skills, js),
            LeaseTable(leases, daemons, js, lease_ttl, nc, timeout),
            PresenceTable(daemons, lease_ttl, js, presence_part_bytes(max_payload)),
        )
