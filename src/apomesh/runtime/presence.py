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
    """Agents it has running on workers now."""
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
        self.log = logger or log

    def record(self) -> DaemonRecord:
        sessions = self.handed_over if self.state == "drained" else self._sessions()
        return DaemonRecord(
            id=self.daemon_id,
            host=self.host,
            url=self.url,
            incarnation=self.incarnation,
            state=self.state,
            sessions=sorted(sessions),
            stranded=sorted(self._stranded()),
            load=self._load(),
            started_at=self.started_at,
            last_seen=time.time(),
        )

    async def publish(self) -> None:
        await self.table.put(self.daemon_id, _encoder.encode(self.record()))

    def nudge(self) -> None:
        """Publish soon: a session was adopted or ended, or the state changed."""
        self._changed.set()

    async def publish_forever(self, interval: float) -> None:
        """Keep the record alive (every ``interval`` and soon after each ``nudge``)."""
        last_write = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), interval)
            self._changed.clear()
            await asyncio.sleep(rewrite_delay(last_write, interval))
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
