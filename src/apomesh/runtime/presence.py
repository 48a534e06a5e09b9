"""Which daemons are alive on this NATS, and this daemon's own record among them.

Several daemons may serve one NATS cluster. Each one keeps a ``DaemonRecord`` in the
``APOMESH_DAEMONS`` KV bucket (``adapters.kv.PresenceTable``): its id (the lease owner name), host,
HTTP URL, incarnation, state, the sessions it drives and those stranded here for an operator, and
when it started and was last seen. ``Presence`` writes it every renewal interval and soon after a
change (``nudge``; ``rewrite_delay`` paces the writes of a large record); the bucket's TTL, the
lease TTL, ages out the record of a daemon that died. The record is what keeps the daemon's
session leases alive (``adapters.kv.LeaseTable``): a lease naming a daemon without a record is
free for a peer to take. A record's ``state`` is ``active``,
``draining`` (it places no new session and is stopping its own at node boundaries) or ``drained``
(it drives nothing any more: the sessions it lists were handed over, their leases released, for
a live peer to adopt at once). ``peers`` answers every live record; a peer's takeover
(``runtime.recovery.Takeover``) reads it to find the sessions of daemons that are gone.

A missing record proves its daemon gone only to a reader whose own record was renewed all along:
when NATS itself stood still (every node frozen, say) or this daemon's loop was held up longer
than a lease TTL, every record aged out at once, the live ones too. ``steady`` says whether this
daemon's record has been renewed without a gap (``RENEWAL_GAP``) for a while; the takeover adopts
nothing until it has been for a lease TTL, time for every live peer to write its record again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from apomesh.adapters.kv import PresenceTable

log = logging.getLogger("apomesh.daemon")

DaemonState = Literal["active", "draining", "drained"]


class DaemonRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One daemon's presence record (msgpack in the ``APOMESH_DAEMONS`` bucket)."""

    id: str
    host: str
    url: str
    incarnation: str
    state: DaemonState = "active"
    sessions: list[str] = []
    """The sessions it drives (for ``drained``: the ones it handed over)."""
    stranded: list[str] = []
    """The sessions on its recoverable list, waiting for an operator there."""
    load: int = 0
    """Agents it has placed on workers and not yet heard the end of (its worker pool's count)."""
    started_at: float = 0.0
    last_seen: float = 0.0

    @property
    def gone(self) -> bool:
        """Whether its sessions are for a peer to adopt: it drained them away."""
        return self.state == "drained"


REWRITE_SHARE = 10
"""After a nudge the record is written again no sooner than this many times its last write took:
a record listing tens of thousands of sessions takes tens of milliseconds to build and send, and
a burst of changes would otherwise keep the event loop writing it."""


RENEWAL_GAP = 2.0
"""Renewals of the record further apart than this many renewal intervals (or a failed one) are a
gap: the records of live peers may have aged out meanwhile as this daemon's own may have."""


def rewrite_delay(last_write: float, interval: float) -> float:
    """How long to gather changes before the next write, given the last one took ``last_write``
    seconds: at least 50 ms (a burst of changes is one write), ``REWRITE_SHARE`` times the last
    write for a large record, never more than a quarter of the renewal ``interval``."""
    return min(interval / 4, max(0.05, REWRITE_SHARE * last_write))


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DaemonRecord)


class Presence:
    """This daemon's record in the presence bucket, and everyone's."""

    def __init__(
        self,
        table: PresenceTable,
        *,
        incarnation: str,
        url: str,
        sessions: Callable[[], list[str]],
        stranded: Callable[[], list[str]],
        load: Callable[[], int] = lambda: 0,
        renew_every: float = 5.0,
        logger: logging.Logger | None = None,
    ) -> None:
        self.table = table
        self.daemon_id = incarnation  # the data dir's stable id, set when the daemon starts
        self.incarnation = incarnation
        self.url = url
        self.host = socket.gethostname()
        self.state: DaemonState = "active"
        self.handed_over: list[str] = []
        self.started_at = time.time()
        self._sessions = sessions
        self._stranded = stranded
        self._load = load
        self._changed = asyncio.Event()
        self.known: dict[str, DaemonRecord] = {}
        """The last records read (``peers``), this daemon's own included."""
        self.renew_every = renew_every
        self._renewed_at: float | None = None
        """When the record was last written (monotonic), None before the first write."""
        self._steady_since: float | None = float("-inf")
        """Since when it has been renewed without a gap (monotonic); None after a failed write."""
        self.log = logger or log

    def record(self) -> DaemonRecord:
        """This daemon's record now. The session lists are in no particular order (readers take
        them as sets): sorting 10,000 ids took a record beside 10,000 parked sessions several
        milliseconds of the event loop, two or three times in a run of the standard workload."""
        sessions = list(self.handed_over) if self.state == "drained" else self._sessions()
        return DaemonRecord(
            id=self.daemon_id,
            host=self.host,
            url=self.url,
            incarnation=self.incarnation,
            state=self.state,
            sessions=sessions,
            stranded=self._stranded(),
            load=self._load(),
            started_at=self.started_at,
            last_seen=time.time(),
        )

    async def publish(self) -> None:
        try:
            await self.table.put(self.daemon_id, _encoder.encode(self.record()))
        except BaseException:
            self._steady_since = None
            raise
        now = time.monotonic()
        last = self._renewed_at
        if self._steady_since is None or (
            last is not None and now - last > RENEWAL_GAP * self.renew_every
        ):
            if last is not None:
                self.log.info(
                    "presence record renewed again after %.1f s: the records of live peers may "
                    "have aged out meanwhile, so none is taken for gone for a lease TTL",
                    now - last,
                )
            self._steady_since = now
        self._renewed_at = now

    def steady(self, settle: float) -> bool:
        """Whether this daemon's record has been renewed without a gap for ``settle`` seconds and
        is not overdue now: only then does a peer's missing record say that peer is gone."""
        now = time.monotonic()
        return (
            self._steady_since is not None
            and self._renewed_at is not None
            and now - self._steady_since >= settle
            and now - self._renewed_at <= RENEWAL_GAP * self.renew_every
        )

    def nudge(self) -> None:
        """Publish soon: a session was adopted or ended, or the state changed."""
        self._changed.set()

    async def publish_forever(self) -> None:
        """Keep the record alive (every ``renew_every`` and soon after each ``nudge``)."""
        last_write = 0.0
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for answers a wait that ended in
            # the very tick it was cancelled (a nudge from the shutdown's last session ending)
            # and drops the cancellation, and this loop would hold the shutdown for ever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.renew_every):
                    await self._changed.wait()
            self._changed.clear()
            await asyncio.sleep(rewrite_delay(last_write, self.renew_every))
            began = time.perf_counter()
            try:
                await self.publish()
            except Exception as exc:
                self.log.warning("presence record not renewed: %s", exc)
            last_write = time.perf_counter() - began

    async def withdraw(self) -> None:
        with contextlib.suppress(Exception):
            await self.table.delete(self.daemon_id)

    async def peers(self) -> dict[str, DaemonRecord]:
        """Every live daemon's record, by id (this one's included); undecodable ones are left
        out, loudly."""
        records: dict[str, DaemonRecord] = {}
        for daemon_id, raw in (await self.table.all()).items():
            try:
                records[daemon_id] = _decoder.decode(raw)
            except msgspec.DecodeError as exc:
                self.log.warning(
                    "ignored the undecodable presence record of %s: %s", daemon_id, exc
                )
        self.known = records
        return records

    async def live_peers(self) -> list[DaemonRecord]:
        """The other daemons that are alive and take sessions."""
        return [
            r
            for r in (await self.peers()).values()
            if r.id != self.daemon_id and r.state == "active"
        ]

    def url_of(self, daemon_id: str | None) -> str:
        """The advertised HTTP URL of a daemon last seen, or ``""``."""
        record = self.known.get(daemon_id or "")
        return record.url if record is not None else ""
